"""Where each poller stands: checkpoint, lease, fingerprint, lag and its queue's depth (a topic
poller: each subscription's depth and dead-letter count).

Every part is gathered independently: a storage outage still shows the source lag, a database
outage still shows the lease. Failures become an ``error`` field, never an exception.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from azure.servicebus import ServiceBusClient

from dbfanout.ops.bus import (
    SESSION_QUEUE_ACTIVE,
    Entity,
    as_entity,
    is_emulator,
    peek_all,
    refuses_non_session,
)
from dbfanout.ops.checkpoints import lease_state
from dbfanout.ops.context import open_store
from dbfanout.ops.snapshot_checks import initial_too_late
from poller.ports import SOURCE_NOTES
from poller.sources.engines import source_engine
from poller.sources.factory import open_source
from poller.sources.mysql_binlog.source import MysqlBinlogSource
from poller.sources.pg_logical.relations import TRUNCATE_NOTE
from poller.sources.pg_logical.slot import lost_error, read_slot
from poller.sources.pg_logical.source import PgLogicalSource
from poller.tick.backoff import refusal_from_metadata
from shared.codec import encode_position, encode_value
from shared.config import Config, PollerConfig
from shared.errors import DbFanoutError, PositionLostError, SourceError
from shared.models import Position, SnapshotState
from shared.settings import redact_url

__all__ = [
    "PENDING_LIMIT",
    "dead_letter_problems",
    "poller_status",
    "queue_depth",
    "row_problems",
    "sink_refusing",
    "sink_refusing_line",
    "snapshot_line",
    "snapshot_progress",
    "storage_queue_depth",
    "topic_depth",
    "truncate_line",
]

PENDING_LIMIT = 1000  # count pending rows up to this many (one bounded keyset read)
PEEK_COUNT_LIMIT = 1000


def _error(exc: Exception) -> str:
    if isinstance(exc, PositionLostError):
        return str(exc)  # what was lost, and (its hint) the one command that recovers
    return str(exc.args[0]) if isinstance(exc, DbFanoutError) and exc.args else f"{type(exc).__name__}: {exc}"


def _newest_cursor(cfg: PollerConfig) -> Any:
    cursor: sa.ColumnClause[Any] = sa.column(cfg.cursor)
    if cfg.table:
        schema, _, name = cfg.table.rpartition(".")
        source: Any = sa.table(name, cursor, schema=schema or None)
    else:
        source = sa.text(cfg.query or "").columns(cursor).subquery("dbfanout_src")
    with source_engine(cfg).connect() as conn:
        return conn.execute(sa.select(sa.func.max(source.c[cfg.cursor]))).scalar()


def _lag(newest: Any, checkpoint: Any) -> Any:
    if newest is None or checkpoint is None:
        return None
    try:
        diff = newest - checkpoint
    except TypeError:
        return None
    return diff.total_seconds() if isinstance(diff, dt.timedelta) else diff


def poller_status(config: Config, name: str, now: dt.datetime) -> dict[str, Any]:
    """One poller's state as a JSON-ready dict."""
    cfg = config.poller(name)
    out: dict[str, Any] = {"poller": name, "queue": cfg.queue}
    if cfg.is_topic:
        out["topic"] = cfg.queue
    source = open_source(cfg)
    position = None
    try:
        snap = open_store(config, name).load()
        if snap is None:
            out["state"] = "no state yet (never ran)"
        else:
            doc, lease = snap.doc, snap.doc.lease
            position = doc.checkpoint.position
            out["checkpoint"] = {
                "cursor": encode_position(position),
                "last_batch_id": doc.checkpoint.last_successful_batch_id,
                "updated_at": doc.checkpoint.updated_at.isoformat() if doc.checkpoint.updated_at else None,
            }
            expires = (lease.expires_at - now).total_seconds() if lease.expires_at else None
            out["lease"] = {
                "state": lease_state(lease, now, cfg.lease_ttl_seconds),
                "owner": lease.owner_id,
                "fencing_token": lease.fencing_token,
                "expires_in_seconds": round(expires, 1) if expires is not None and lease.owner_id else None,
                # A running app keeps its lease between ticks: since when this owner holds it.
                "held_since": lease.acquired_at.isoformat() if lease.owner_id and lease.acquired_at else None,
                "renewed_at": lease.heartbeat_at.isoformat() if lease.owner_id and lease.heartbeat_at else None,
            }
            out["fingerprint_match"] = doc.source_fingerprint == source.fingerprint
            out["sink_refusing"] = sink_refusing(doc.checkpoint.metadata, now)
            if truncate := (doc.checkpoint.metadata.get(SOURCE_NOTES) or {}).get(TRUNCATE_NOTE):
                out["last_truncate"] = truncate  # pg_logical: never delivered as an event, so shown here
            if truncates := (doc.checkpoint.metadata.get(SOURCE_NOTES) or {}).get("truncates"):
                out["truncates"] = truncates  # mysql_binlog: the TRUNCATEs read, never delivered as rows
            if position is not None and position.snapshot is not None:
                out["snapshot"] = snapshot_progress(position.snapshot, doc.checkpoint.updated_at)
            if late := initial_too_late(cfg, position):
                out["snapshot_hint"] = late
    except Exception as exc:  # storage down: still show the source side
        out["state_error"] = _error(exc)
    try:
        if isinstance(source, PgLogicalSource):
            out["source"] = _slot_source(source, cfg, position)
            return out
        if isinstance(source, MysqlBinlogSource):  # its log is not read for a status: no stream opened
            out["source"] = source.binlog_status(position)
            return out
        page = source.fetch(position, PENDING_LIMIT)  # first: its errors name what a migration changed
        newest = _newest_cursor(cfg)
        out["source"] = {
            "newest_cursor": encode_value(newest)[0] if newest is not None else None,
            "pending_rows": len(page.rows) if len(page.rows) < PENDING_LIMIT else f">={PENDING_LIMIT}",
            "lag": _lag(newest, position.cursor if position else None),
            "null_cursors_skipped": page.skipped_null_cursors,
        }
    except Exception as exc:  # database down: still show the state side
        out["source_error"] = _error(exc)
    return out


def sink_refusing(metadata: Mapping[str, Any], now: dt.datetime) -> dict[str, Any] | None:
    """The broker's refusal the poller recorded (queue full, throttled, unreachable), or None.

    ``{"reason", "since", "for_seconds", "error"}``: written once when the refusal started and
    cleared by the next page the broker accepted; the poller backs off meanwhile.
    """
    refusal = refusal_from_metadata(metadata)
    if refusal is None:
        return None
    since = refusal.get("since")
    seconds = None
    if isinstance(since, str):
        try:
            started = dt.datetime.fromisoformat(since)
            seconds = round((now - started).total_seconds(), 1)
        except (TypeError, ValueError):
            pass
    return {"reason": refusal["reason"], "since": since, "for_seconds": seconds, "error": refusal.get("error")}


def sink_refusing_line(refusal: Mapping[str, Any]) -> str:
    """:func:`sink_refusing` as one line: ``broker refusing (queue_full) since 2026-… (for 120 s), backing off``."""
    text = f"broker refusing ({refusal['reason']}) since {str(refusal.get('since'))[:19]}"
    if refusal.get("for_seconds") is not None:
        text += f" (for {refusal['for_seconds']:.0f} s)"
    return text + ", backing off; the checkpoint holds"


def truncate_line(note: Mapping[str, Any]) -> str:
    """A pg_logical poller's last TRUNCATE (from the checkpoint's notes), in words."""
    return (
        f"last TRUNCATE of {', '.join(note.get('tables') or [])} at {note.get('lsn')} ({note.get('committed_at')}), "
        f"{note.get('count')} so far: not delivered, targets keep the rows"
    )


def snapshot_progress(state: SnapshotState, landed_at: dt.datetime | None) -> dict[str, Any]:
    """A pg_logical or mysql_binlog poller's snapshot as of its last landed checkpoint: table, chunks, rows, rate, ETA.

    The rate is rows over the time from its start to that checkpoint; the ETA needs the planner's
    row estimate taken at the start (None when the tables were never analysed).
    """
    status = "cancelled" if state.cancelled else "failed" if state.error else "running" if state.active else "done"
    end = state.finished_at or landed_at
    seconds = (end - state.started_at).total_seconds() if end and state.started_at else None
    rate = state.rows / seconds if seconds and seconds > 0 else None
    eta = None
    if state.active and rate and state.estimate is not None:
        eta = round(max(state.estimate - state.rows, 0) / rate, 1)
    return {
        "id": state.id,
        "status": status,
        "table": state.tables[0] if state.tables else None,
        "tables_left": list(state.tables),
        "last_key": None if state.last_key is None else {k: encode_value(v)[0] for k, v in state.last_key.items()},
        "where": state.where,
        "chunk_size": state.chunk_size,
        "chunks": state.chunks,
        "rows": state.rows,
        "estimated_rows": state.estimate,
        "rows_per_second": round(rate, 1) if rate is not None else None,
        "eta_seconds": eta,
        "started_at": state.started_at.isoformat() if state.started_at else None,
        "finished_at": state.finished_at.isoformat() if state.finished_at else None,
        "error": state.error,
        "chunks_refused": state.refused,
    }


def snapshot_line(snap: Mapping[str, Any]) -> str:
    """:func:`snapshot_progress` as one line (``status``, the demo's view): ``snapshot running:
    public.orders, chunk 12, 5500 rows of ~10000, 2400 rows/s, ETA 2s``."""
    text = f"snapshot {snap['status']}: "
    if snap["status"] == "running":
        text += f"{snap['table']}, chunk {snap['chunks'] + 1}, "
    text += f"{snap['rows']} rows"
    if snap.get("estimated_rows") is not None:
        text += f" of ~{snap['estimated_rows']}"
    if snap.get("rows_per_second") is not None:
        text += f", {snap['rows_per_second']:.0f} rows/s"
    if snap.get("eta_seconds") is not None:
        text += f", ETA {snap['eta_seconds']:.0f}s"
    if snap.get("error"):
        text += f" ({snap['error']})"
    if snap.get("chunks_refused"):
        text += (f"; {snap['chunks_refused']} chunk read(s) refused: a commit was not visible yet (a synchronous "
                 "standby or a busy server), retried with smaller chunks")  # fmt: skip
    return text


def _slot_source(source: PgLogicalSource, cfg: PollerConfig, position: Position | None) -> dict[str, Any]:
    """A pg_logical poller: its slot, how much WAL it holds and how far behind the log it is.

    The slot is not read: a peek takes the slot for its duration, and a tick peeking at the same
    moment would fail. ``lag_bytes`` (WAL after the slot's confirmed position) is the backlog. A
    lost slot is the poller's own error (what was lost, and the command that recovers).
    """
    slot = source.slot_status()
    if slot is None or slot["wal_status"] == "lost":
        with source_engine(cfg).connect() as conn:
            health = read_slot(conn, source.slot)
        if health.lost:
            if position is None and not health.present:
                raise SourceError(
                    f"replication slot {source.slot!r} does not exist (create it: `dbfanout validate --fix`)"
                )
            raise lost_error(cfg, health, position, redact_url(cfg.source_url))
        slot = source.slot_status()  # replaced meanwhile
        if slot is None:
            raise SourceError(f"replication slot {source.slot!r} does not exist")
    mib = 1024 * 1024
    return {
        **slot,
        "lag": f"{slot['lag_bytes'] / mib:.1f} MiB of WAL (retains {slot['retained_wal_bytes'] / mib:.1f} MiB)",
    }


def _runtime_counts(config: Config, entity: Entity) -> tuple[int | None, int | None]:
    """(active, dead-lettered) from the management API (needs the Manage right)."""
    from azure.servicebus.management import ServiceBusAdministrationClient

    conn = config.settings.get(config.app.servicebus_connection) or ""
    with ServiceBusAdministrationClient.from_connection_string(conn) as admin:
        if entity.subscription is None:
            queue = admin.get_queue_runtime_properties(entity.name)
            return queue.active_message_count, queue.dead_letter_message_count
        sub = admin.get_subscription_runtime_properties(entity.name, entity.subscription)
        return sub.active_message_count, sub.dead_letter_message_count


def queue_depth(config: Config, client: ServiceBusClient, queue: str | Entity) -> dict[str, Any]:
    """Active and dead-lettered counts of a queue or one subscription: runtime properties on Azure,
    bounded peeks on the emulator (or without the Manage right)."""
    entity = as_entity(queue)
    queue = entity.label
    if not is_emulator(config):
        try:
            active, dead = _runtime_counts(config, entity)
            return {"queue": queue, "active": active, "dead_lettered": dead, "how": "runtime properties"}
        except Exception as exc:  # no Manage right, or an identity-based connection: fall back to peeking
            fallback = _error(exc)
    else:
        fallback = None

    def count(dead_letter: bool) -> int | str:
        n = sum(1 for _ in peek_all(client, entity, dead_letter=dead_letter, limit=PEEK_COUNT_LIMIT))
        return n if n < PEEK_COUNT_LIMIT else f">={PEEK_COUNT_LIMIT}"

    result: dict[str, Any] = {"queue": queue}
    try:
        result["active"] = count(False)
    except Exception as exc:
        if not refuses_non_session(exc):
            return {"queue": queue, "error": _error(exc)}
        # A session queue: its dead-letter sub-queue is not session-enabled and still peeks.
        result.update(active=None, active_unknown=SESSION_QUEUE_ACTIVE, requires_session=True)
    try:
        result.update(dead_lettered=count(True), how="peeked")
    except Exception as exc:
        return {"queue": queue, "error": _error(exc)}
    if fallback:
        result["admin_error"] = fallback
    return result


def _total(values: list[Any]) -> int | str | None:
    """The sum of per-subscription counts; ``>=N`` when one is a lower bound; None when none is known."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    total = sum(v if isinstance(v, int) else int(str(v).lstrip(">=")) for v in known)
    exact = len(known) == len(values) and all(isinstance(v, int) for v in known)
    return total if exact else f">={total}"


def topic_depth(config: Config, client: ServiceBusClient, cfg: PollerConfig) -> dict[str, Any]:
    """A topic poller's subscriptions, each with its active and dead-letter count.

    Returns ``{"subscriptions": [{"name", "active", "dead_letter", "how", ...}], "queue_depth": {...}}``
    where ``queue_depth`` sums them (the key queue pollers have, so readers of it keep working).
    """
    subs: list[dict[str, Any]] = []
    for name in sorted(cfg.subscriptions):
        depth = queue_depth(config, client, Entity(cfg.queue, name))
        row: dict[str, Any] = {"name": name, "active": depth.get("active"), "dead_letter": depth.get("dead_lettered")}
        row.update({k: v for k, v in depth.items() if k not in ("queue", "active", "dead_lettered")})
        subs.append(row)
    total: dict[str, Any] = {
        "queue": cfg.queue,
        "active": _total([s["active"] for s in subs]),
        "dead_lettered": _total([s["dead_letter"] for s in subs]),
        "how": "sum over subscriptions",
    }
    errors = [f"{s['name']}: {s['error']}" for s in subs if "error" in s]
    if errors:
        total["error"] = "; ".join(errors)
    return {"subscriptions": subs, "queue_depth": total}


def storage_queue_depth(config: Config, queue: str) -> dict[str, Any]:
    """A storage-queue poller's queue and its poison queue (approximate counts from the service)."""
    from shared.settings import storage_connection
    from shared.storagequeue import poison_queue_name, queue_service_client

    try:
        service = queue_service_client(storage_connection(config.settings, config.app.storage_queue_connection))
        active = service.get_queue_client(queue).get_queue_properties().approximate_message_count
        poison = service.get_queue_client(poison_queue_name(queue))
        try:
            dead = poison.get_queue_properties().approximate_message_count
        except Exception:  # no poison queue yet: nothing has been poisoned
            dead = 0
    except Exception as exc:
        return {"queue": queue, "error": _error(exc)}
    return {"queue": queue, "active": active, "dead_lettered": dead, "how": "approximate counts (poison queue)"}


def _counted(count: Any) -> bool:
    """A depth count that is above zero: an int, or a lower bound such as ``>=1000``."""
    return (isinstance(count, int) and count > 0) or (isinstance(count, str) and count.startswith(">="))


def dead_letter_problems(row: Mapping[str, Any]) -> list[str]:
    """One line per queue or subscription holding dead-lettered (a storage queue: poisoned) messages,
    with the command that shows them: each one is a change no handler has carried out."""
    depth = row.get("queue_depth") or {}
    if "topic" in row:
        found = [(f"{row['topic']}/{s['name']}", s.get("dead_letter")) for s in row.get("subscriptions") or []]
    else:
        found = [(str(depth.get("queue") or row["queue"]), depth.get("dead_lettered"))]
    return [
        f"{count} dead-lettered message(s) in {entity}: `dbfanout dlq peek {entity}`"
        for entity, count in found
        if _counted(count)
    ]


def row_problems(row: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` of one :func:`poller_status` row with its depth. A problem makes
    ``status`` exit 1 (state or source unreadable, fingerprint mismatch, a refusing broker, dead
    letters); a note is shown and does not (never ran yet, depth unknown, a snapshot under way)."""
    problems = [str(row[k]) for k in ("state_error", "source_error") if k in row]
    if row.get("fingerprint_match") is False:
        problems.append("source fingerprint MISMATCH: the config no longer reads what the checkpoint was taken on")
    if row.get("sink_refusing"):
        problems.append(sink_refusing_line(row["sink_refusing"]))
    problems += dead_letter_problems(row)
    depth = row.get("queue_depth") or {}
    notes = [str(row["state"])] if "state" in row else []
    notes += [f"queue depth unknown: {depth['error']}"] if "error" in depth else []
    notes += [snapshot_line(row["snapshot"])] if "snapshot" in row else []
    notes += [str(row["snapshot_hint"])] if "snapshot_hint" in row else []
    # TRUNCATEs read from the log are never delivered as events (docs/operations.md, "TRUNCATE"): a
    # note, not a problem, since the checkpoint keeps the record after the targets were dealt with
    notes += [truncate_line(row["last_truncate"])] if "last_truncate" in row else []
    notes += [f"TRUNCATE of {t.get('table')} at {t.get('at')} not delivered" for t in row.get("truncates") or ()]
    return problems, notes
