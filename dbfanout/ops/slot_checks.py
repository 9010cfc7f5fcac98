"""``dbfanout validate`` for a ``kind = "pg_logical"`` poller: server, publication, slot, WAL held.

With ``--fix`` the snapshot signal table, the publication and the slot are created (publication
first: a slot decodes with the catalog as of each change, so a publication created after the slot
is unknown to the changes before it), and a signal table missing from the publication is added.
Nothing else ever creates them: a tick that finds no slot fails and says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import sqlalchemy as sa

from dbfanout.ops.checks import Check
from poller.snapshot.postgres import request_statement, signal_sql
from poller.sources.engines import source_engine
from poller.sources.pg_logical.publication import (
    PUBLISH,
    VIA_ROOT_SINCE,
    PublicationState,
    create_publication_sql,
    create_slot_sql,
    missing_tables,
    partitioned_tables,
    publication_repairs,
    quote_table,
    read_publication,
    server_version,
)
from poller.sources.pg_logical.slot import RUNBOOK, replace_slot
from poller.sources.pg_logical.source import PgLogicalSource
from shared.config import PollerConfig

__all__ = ["DEFAULT_RETAINED_WARN_BYTES", "slot_checks"]

#: An inactive slot holding more WAL than this is worth a look (disk on the server fills up).
DEFAULT_RETAINED_WARN_BYTES = 1024**3

_IDENTITY = sa.text(
    "SELECT c.relreplident, EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary)"
    " FROM pg_class c WHERE c.oid = to_regclass(:table)"
)


def slot_checks(
    cfg: PollerConfig, *, fix: bool = False, retained_warn_bytes: int = DEFAULT_RETAINED_WARN_BYTES
) -> Iterator[Check]:
    """The checks (and, with ``fix``, the repairs) of one pg_logical poller."""
    p = cfg.name
    try:
        with source_engine(cfg).connect() as conn:
            level = conn.execute(sa.text("SHOW wal_level")).scalar()
            if level != "logical":
                yield Check(
                    p,
                    "wal_level",
                    "fail",
                    f"wal_level is {level}: set it to logical and restart the server "
                    "(Azure Flexible Server: server parameter wal_level = LOGICAL); see docs/operations.md",
                )
                return
            yield Check(p, "wal_level", "ok", "logical")
            yield from _table_checks(conn, cfg)
            yield from _signal_check(conn, cfg, fix)
            yield from _publication_check(conn, cfg, fix)
        yield from _slot_check(cfg, fix, retained_warn_bytes)
    except Exception as exc:  # a database error is a failed check, never a crash of validate
        yield Check(p, "pg_logical", "fail", f"{type(exc).__name__}: {exc}")


def _table_checks(conn: sa.Connection, cfg: PollerConfig) -> Iterator[Check]:
    for table in cfg.tables:
        row = conn.execute(_IDENTITY, {"table": quote_table(table)}).first()
        if row is None:
            yield Check(cfg.name, "table", "fail", f"table {table} does not exist")
            continue
        identity, has_pk = row[0], row[1]
        if not has_pk and not cfg.pk:
            yield Check(cfg.name, "table", "fail", f"{table} has no primary key: add one, or set pk")
        elif identity == "n":
            yield Check(
                cfg.name,
                "replica identity",
                "fail",
                f"{table} has REPLICA IDENTITY NOTHING: updates "
                "and deletes cannot be decoded; ALTER TABLE ... REPLICA IDENTITY DEFAULT (or FULL)",
            )
        else:
            what = "deletes carry the whole old row" if identity == "f" else "deletes carry the old key only"
            yield Check(
                cfg.name, "replica identity", "ok", f"{table}: {'FULL' if identity == 'f' else 'DEFAULT'} ({what})"
            )


def _signal_check(conn: sa.Connection, cfg: PollerConfig, fix: bool) -> Iterator[Check]:
    """The snapshot signal table (watermarks and `dbfanout snapshot` requests)."""
    (create,) = signal_sql(cfg)
    if conn.execute(sa.text("SELECT to_regclass(:t)"), {"t": quote_table(cfg.signal_table)}).scalar() is not None:
        yield Check(cfg.name, "signal table", "ok", f"{cfg.signal_table} exists")
    elif fix:
        conn.execute(sa.text(create))
        conn.commit()
        yield Check(cfg.name, "signal table", "ok", f"created: {create}")
    else:
        yield Check(
            cfg.name,
            "signal table",
            _needed(cfg),
            f"{cfg.signal_table} does not exist (snapshots need it): run `dbfanout validate --fix`, or: {create}",
        )


def _needed(cfg: PollerConfig) -> Literal["fail", "warn"]:
    """What a missing signal table is: a failure with snapshot = "initial"; else a warning (only
    `dbfanout snapshot` needs it, and existing pollers stream without it)."""
    return "fail" if cfg.snapshot == "initial" else "warn"


def _publication_check(conn: sa.Connection, cfg: PollerConfig, fix: bool) -> Iterator[Check]:
    """The publication: every table, every kind of change (truncate too), partitions under their root.

    ``--fix`` creates it or runs exactly the statements it lacks (and says which); run again, it
    finds nothing to change and says so.
    """
    assert cfg.publication is not None
    version = server_version(conn)
    partitioned = partitioned_tables(conn, cfg.tables)
    if partitioned and version < VIA_ROOT_SINCE:
        yield Check(
            cfg.name,
            "publication",
            "fail",
            f"{', '.join(partitioned)} is partitioned: PostgreSQL {version // 10000} cannot publish a partitioned "
            "table (13+ can, with publish_via_partition_root): name its partitions in tables instead",
        )
        return
    state = read_publication(conn, cfg.publication)
    if state is None:
        yield _create_publication(conn, cfg, fix, version)
    else:
        yield _repair_publication(conn, cfg, fix, state, partitioned)


def _create_publication(conn: sa.Connection, cfg: PollerConfig, fix: bool, version: int) -> Check:
    create = create_publication_sql(cfg, version)
    if not fix:
        return Check(
            cfg.name,
            "publication",
            "fail",
            f"{cfg.publication} does not exist: run `dbfanout validate --fix`, or: {create}",
        )
    conn.execute(sa.text(create))
    conn.commit()
    return Check(cfg.name, "publication", "ok", f"created: {create}")


def _repair_publication(
    conn: sa.Connection, cfg: PollerConfig, fix: bool, state: PublicationState, partitioned: list[str]
) -> Check:
    """An existing publication: what it lacks, in words; with ``fix``, the statements run."""
    repairs = publication_repairs(cfg, state, partitioned)
    if repairs and fix:
        for statement in repairs:
            conn.execute(sa.text(statement))
        conn.commit()
        return Check(cfg.name, "publication", "ok", f"changed {cfg.publication}: {'; '.join(repairs)}")
    if repairs:
        missing = missing_tables(cfg, state)
        # A table or a partition root missing loses changes: a failure. The signal table (snapshots)
        # and truncate (a publication made before it was asked for) stream on without: a warning.
        lost = any(t != cfg.signal_table for t in missing) or (bool(partitioned) and state.via_root is False)
        status: Literal["fail", "warn"] = "fail" if lost else _needed(cfg) if missing else "warn"
        return Check(
            cfg.name,
            "publication",
            status,
            f"{cfg.publication} {_lacks(cfg, state, missing, partitioned)}"
            + (" (snapshots need it)" if missing == [cfg.signal_table] else "")
            + f": {'; '.join(repairs)} (or --fix)",
        )
    return Check(
        cfg.name,
        "publication",
        "ok",
        f"{cfg.publication} publishes {', '.join(cfg.tables)} ({PUBLISH}"
        + (", partitions under their root" if partitioned else "")
        + ")"
        + ("; nothing to change" if fix else ""),
    )


def _lacks(cfg: PollerConfig, state: PublicationState, missing: list[str], partitioned: list[str]) -> str:
    """What the publication lacks, in words."""
    lacks = [f"does not publish {', '.join(missing)}"] if missing else []
    if not state.every_kind:
        lacks.append(f"does not publish every kind of change ({PUBLISH}: a TRUNCATE would go unseen)")
    if partitioned and state.via_root is False:
        lacks.append(
            f"publishes the partitions of {', '.join(partitioned)} under their own names "
            "(publish_via_partition_root is off: the poller would not know them)"
        )
    return "; ".join(lacks)


def _slot_check(cfg: PollerConfig, fix: bool, warn_bytes: int) -> Iterator[Check]:
    source = PgLogicalSource(cfg)
    slot = source.slot_status()
    if slot is None:
        create = create_slot_sql(cfg)
        if not fix:
            yield Check(
                cfg.name,
                "slot",
                "fail",
                f"replication slot {source.slot} does not exist: run `dbfanout validate --fix`, or: {create}",
            )
            return
        with source_engine(cfg).begin() as conn:  # a transaction of its own (no writes before it)
            conn.execute(sa.text(create))
        yield Check(
            cfg.name,
            "slot",
            "ok",
            f"created: {create} (if the poller ran before, the changes since its checkpoint are not in it: "
            f"`dbfanout snapshot {cfg.name}` re-delivers every current row)",
        )
        return
    if slot["wal_status"] == "lost" and fix:
        yield from _replace_lost(cfg, slot)
        return
    yield from _slot_health(cfg, slot, warn_bytes)


def _replace_lost(cfg: PollerConfig, slot: dict[str, Any]) -> Iterator[Check]:
    """A slot PostgreSQL invalidated: drop it, create it again, then request a snapshot of every table.

    The request is written after the new slot exists, so it reaches the poller through it; the
    snapshot re-delivers every current row, the rows changed while the slot was lost included.
    """
    name, lost_at = slot["slot"], slot["confirmed_flush_lsn"]
    start = replace_slot(source_engine(cfg), name)
    yield Check(
        cfg.name,
        "slot",
        "ok",
        f"{name} was lost (wal_status = lost; the changes after {lost_at} are gone from the log): replaced, "
        f"the new slot starts at {start}",
    )
    statement, params = request_statement(cfg)
    try:
        with source_engine(cfg).begin() as conn:
            conn.execute(statement, params)
    except Exception as exc:  # the slot is replaced; the snapshot can still be asked for by hand
        yield Check(
            cfg.name,
            "snapshot",
            "fail",
            f"could not request the snapshot that re-delivers the rows changed while {name} was lost "
            f"({type(exc).__name__}: {exc}): run `dbfanout snapshot {cfg.name}`",
        )
        return
    yield Check(
        cfg.name,
        "snapshot",
        "ok",
        f"requested a snapshot of every table (request {params['id']}): it re-delivers every current row, those "
        f"changed while {name} was lost included (a row deleted meanwhile is not: reconcile the target); "
        f"follow it with `dbfanout status {cfg.name}`",
    )


def _slot_health(cfg: PollerConfig, slot: dict[str, Any], warn_bytes: int) -> Iterator[Check]:
    name, retained = slot["slot"], slot["retained_wal_bytes"]
    if slot["plugin"] != "pgoutput":
        yield Check(cfg.name, "slot", "fail", f"{name} uses {slot['plugin']}, not pgoutput: drop and re-create it")
    elif slot["wal_status"] == "lost":
        yield Check(
            cfg.name,
            "slot",
            "fail",
            f"{name} lost WAL it needed (wal_status = lost, max_slot_wal_keep_size): the changes after "
            f"{slot['confirmed_flush_lsn']} are gone from the log; run `dbfanout validate --fix {cfg.name}` (it "
            f"replaces the slot and requests a snapshot of every table); see {RUNBOOK}",
        )
    elif slot["wal_status"] == "unreserved":
        yield Check(
            cfg.name,
            "slot",
            "warn",
            f"{name} holds back more WAL than max_wal_size (wal_status = unreserved, "
            f"{retained / 1024**2:.0f} MiB): PostgreSQL invalidates it at its next checkpoint unless the poller "
            f"catches up; see {RUNBOOK}",
        )
    elif not slot["active"] and retained > warn_bytes:
        yield Check(
            cfg.name,
            "slot",
            "warn",
            f"{name} is inactive and retains {retained / 1024**2:.0f} MiB of WAL "
            "(is the poller running and caught up?); see 'WAL retention' in docs/operations.md",
        )
    else:
        yield Check(
            cfg.name,
            "slot",
            "ok",
            f"{name} at {slot['confirmed_flush_lsn']}, retains {retained / 1024**2:.1f} MiB of WAL",
        )
