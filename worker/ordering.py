"""Apply only if newer: the guard every handler that replicates rows needs, beside ``ProcessedEvents``.

Why: delivery is at-least-once and, without ``sessions = true``, concurrent workers race: a
redelivered or slower message can reach the handler after a newer change of the same key — a
snapshot's ``read`` after the stream's update of that row, an update after the delete that
followed it. Keep the newest cursor applied per key (deletes included, so a late upsert never
resurrects a deleted row) and skip what is not newer, **in the same transaction** as the side
effect:

    versions = LatestVersions(engine)                # creates its table if needed
    def handle(events, context):
        with engine.begin() as conn:
            for event in versions.newer(conn, processed.fresh(conn, events)):
                if event.op == "delete":
                    conn.execute(delete(...))
                else:
                    conn.execute(upsert(...))

What orders: an event's ``(epoch, cursor)`` within one poller, never its ``cursor`` alone. A
poller's cursors can go backwards when its source's history changes under it: a MariaDB/MySQL
failover to a server whose GTIDs restart or sort lower (a cursor is ``(server_uuid, gno, seq)`` or
``(domain, seq_no, seq)``), a promotion to a PostgreSQL standby that was behind, a replaced slot.
The poller then starts a new ``epoch`` (:mod:`poller.tick.epochs`), so a later change always has
a greater ``(epoch, cursor)``; a guard on the cursor alone would skip it and every later change of
its key for good. The epoch is stored with the cursor (a row written before epochs existed reads
as epoch 0). Within an epoch the cursor orders: for ``kind = "pg_logical"`` it is ``(commit LSN,
seq)``, and a snapshot's ``read`` carries the log position it was emitted at, which is after every
change its select saw and before every later change of its key, so reads and changes compare
correctly. For keyset pollers it is the cursor column (a version or a timestamp that every write
increases); for outbox pollers the outbox's id. Keys are per poller (two pollers of one table keep
separate versions, and their epochs are their own: never compare events of two pollers).

Works on SQLite, PostgreSQL and MariaDB/MySQL. Two workers racing on the same new key: one insert
fails on the primary key, its transaction rolls back and the message is retried (at-least-once).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa

from shared.codec import decode_value, dumps, encode_value, loads
from shared.models import CursorValue, RowChange

__all__ = ["LatestVersions", "decode_cursor", "decode_version", "encode_cursor", "key_text", "versions_table"]


def versions_table(name: str = "dbfanout_latest_versions", metadata: sa.MetaData | None = None) -> sa.Table:
    """The table :class:`LatestVersions` keeps: ``(poller, pk)`` → the newest cursor and whether it was a delete."""
    return sa.Table(
        name,
        metadata if metadata is not None else sa.MetaData(),
        sa.Column("poller", sa.String(64), primary_key=True),
        sa.Column("pk", sa.String(512), primary_key=True),
        sa.Column("cursor", sa.Text, nullable=False),
        sa.Column("deleted", sa.Boolean, nullable=False),
    )


def key_text(pk: Mapping[str, Any]) -> str:
    """A primary key as canonical JSON text (sorted keys, typed values encoded)."""
    return dumps({k: encode_value(pk[k])[0] for k in sorted(pk)}).decode()


def encode_cursor(cursor: CursorValue, epoch: int = 0) -> str:
    """A cursor (and its order epoch) as text that keeps its types (:func:`decode_version` gives
    both back, :func:`decode_cursor` the cursor)."""
    parts = cursor if isinstance(cursor, tuple) else (cursor,)
    doc: dict[str, Any] = {"v": [encode_value(p) for p in parts], "tuple": isinstance(cursor, tuple)}
    if epoch:  # absent while 0: the text of a version without one is unchanged
        doc["epoch"] = epoch
    return dumps(doc).decode()


def decode_cursor(text: str) -> Any:
    """The cursor of :func:`encode_cursor`'s text."""
    return decode_version(text)[1]


def decode_version(text: str) -> tuple[int, Any]:
    """``(epoch, cursor)`` of :func:`encode_cursor`'s text; epoch 0 when it has none (older rows)."""
    doc = loads(text)
    values = tuple(decode_value(v, t) for v, t in doc["v"])
    return doc.get("epoch", 0), values if doc["tuple"] else values[0]


class LatestVersions:
    """The newest ``(epoch, cursor)`` applied per key; :meth:`newer` lets through only what is newer."""

    def __init__(
        self, engine: sa.Engine, table: str | sa.Table = "dbfanout_latest_versions", *, create: bool = True
    ) -> None:
        self.table = table if isinstance(table, sa.Table) else versions_table(table)
        if create:
            self.table.create(engine, checkfirst=True)

    def newer(self, conn: sa.Connection, events: Iterable[RowChange]) -> list[RowChange]:
        """The events newer than what was applied for their key, recorded as applied (call inside
        the transaction that applies them). Within ``events``, only the newest of a key is kept
        (its state is the key's state). Locks each key's row (``FOR UPDATE``) until the commit."""
        newest: dict[tuple[str, str], RowChange] = {}
        for event in events:
            ident = (event.poller, key_text(event.pk))
            kept = newest.get(ident)
            if kept is None or (event.epoch, event.cursor) > (kept.epoch, kept.cursor):
                newest[ident] = event
        out: list[RowChange] = []
        t = self.table
        for (poller, key), event in newest.items():
            where = (t.c.poller == poller) & (t.c.pk == key)
            stored = conn.execute(sa.select(t.c.cursor).where(where).with_for_update()).scalar_one_or_none()
            # A later epoch is newer whatever its cursor (the cursors went backwards in between).
            if stored is not None and decode_version(stored) >= (event.epoch, event.cursor):
                continue  # a newer (or the same) change of this key was applied already
            version = {"cursor": encode_cursor(event.cursor, event.epoch), "deleted": event.op == "delete"}
            if stored is None:
                conn.execute(sa.insert(t).values(poller=poller, pk=key, **version))
            else:
                conn.execute(sa.update(t).where(where).values(**version))
            out.append(event)
        return out
