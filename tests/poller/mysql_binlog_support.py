"""Helpers for the mysql_binlog tests: uniquely named tables on a server with the binlog on, dropped after."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from poller.sources.mysql_binlog.position import BinlogPosition
from poller.sources.mysql_binlog.reader import BinlogChange, BinlogReader
from poller.sources.mysql_binlog.source import MysqlBinlogSource
from shared.config import PollerConfig, parse_config
from shared.models import Batch, RowChange
from tests.support.databases import unique_name


class BinlogTables:
    """``{t}``: ``id INT PRIMARY KEY, v VARCHAR(40), n INT``; ``{c}``: a composite key ``(a, b)``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.database = sa.make_url(url).database or "test"
        self.name = unique_name("bl")
        self.composite = f"{self.name}_c"
        self.engine = sa.create_engine(url)
        self.config = poller_config(url, [self.qualified, f"{self.database}.{self.composite}"])

    @property
    def qualified(self) -> str:
        return f"{self.database}.{self.name}"

    def create(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {self.name} (id INT PRIMARY KEY, v VARCHAR(40), n INT)"))
            conn.execute(
                sa.text(f"CREATE TABLE {self.composite} (a INT, b VARCHAR(10), v VARCHAR(40), PRIMARY KEY (a, b))")
            )

    def sql(self, *statements: str, params: dict[str, Any] | None = None) -> None:
        """Run the statements in ONE transaction ({t}: the table, {c}: the composite-key one)."""
        with self.engine.begin() as conn:
            for statement in statements:
                conn.execute(sa.text(statement.format(t=self.name, c=self.composite)), params or {})

    def insert(self, ids: Sequence[int], v: str = "x") -> None:
        with self.engine.begin() as conn:
            conn.execute(
                sa.text(f"INSERT INTO {self.name} (id, v, n) VALUES (:id, :v, 0)"), [{"id": i, "v": v} for i in ids]
            )

    def drop(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {self.name}, {self.composite}"))
        self.engine.dispose()


def poller_config(url: str, tables: list[str], **more: Any) -> PollerConfig:
    """Through the real config parser: what a dbfanout.toml with kind = "mysql_binlog" gives."""
    raw: dict[str, Any] = {
        "kind": "mysql_binlog",
        "source_url": url,
        "tables": tables,
        "queue": "changes",
        "batch_size": 50,
        "max_batches_per_tick": 20,
        "lease_ttl_seconds": 30,
        **more,
    }
    return parse_config({"app": {"name": "t"}, "pollers": {"p": raw}}, {}).pollers["p"]


@contextmanager
def binlog_tables(url: str) -> Iterator[BinlogTables]:
    tables = BinlogTables(url)
    try:
        tables.create()
        yield tables
    finally:
        tables.drop()


def events_of(batches: Sequence[Batch]) -> list[RowChange]:
    """Every event, de-duplicated by event id as the queue's duplicate detection would (first wins)."""
    seen: set[str] = set()
    out: list[RowChange] = []
    for batch in batches:
        for event in batch.events:
            if event.event_id not in seen:
                seen.add(event.event_id)
                out.append(event)
    return out


def rebuild(events: Sequence[RowChange]) -> dict[tuple[str, tuple[Any, ...]], dict[str, Any]]:
    """The target a handler builds from the events: upsert on insert/update (the old key of a key
    change removed), remove on delete."""
    target: dict[tuple[str, tuple[Any, ...]], dict[str, Any]] = {}
    for e in events:
        assert e.table is not None
        key = (e.table, tuple(e.pk.values()))
        if e.change == "delete":
            assert e.after is None and e.before is not None
            target.pop(key, None)
            continue
        assert e.after is not None
        if e.before is not None:
            old = (e.table, tuple(e.before[k] for k in e.pk))
            target.pop(old, None)
        target[key] = dict(e.after)
    return target


def source_rows(tables: BinlogTables) -> dict[tuple[str, tuple[Any, ...]], dict[str, Any]]:
    out: dict[tuple[str, tuple[Any, ...]], dict[str, Any]] = {}
    with tables.engine.connect() as conn:
        for r in conn.execute(sa.text(f"SELECT id, v, n FROM {tables.name}")).mappings():
            out[(tables.qualified, (r["id"],))] = dict(r)
        for r in conn.execute(sa.text(f"SELECT a, b, v FROM {tables.composite}")).mappings():
            out[(f"{tables.database}.{tables.composite}", (r["a"], r["b"]))] = dict(r)
    return out


class Versions:
    """Writes to ``{t}`` (``id``, ``v``, ``n``) that set ``n`` to a version growing per key in commit
    order, whoever writes: a row of ``{t}_gen`` per key, bumped first in the same transaction, holds
    the key's lock until the commit. A delete sets the version first, so its before image carries it.
    Snapshot tests check delivery against these versions (:func:`stale_or_resurrected`)."""

    def __init__(self, table: str) -> None:
        """``table``: the name of a :class:`BinlogTables`' ``{t}`` (in the connection's database)."""
        self.table, self.gen = table, f"{table}_gen"

    def create(self, engine: sa.Engine) -> None:
        with engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE IF NOT EXISTS {self.gen} (id INT PRIMARY KEY, g INT NOT NULL)"))

    def drop(self, engine: sa.Engine) -> None:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {self.gen}"))

    def write(self, conn: sa.Connection, key: int, op: str, v: str = "w") -> None:
        """``op``: update, delete or upsert, in the caller's transaction (it commits)."""
        args: dict[str, Any] = {"k": key, "v": v}
        conn.execute(sa.text(f"INSERT INTO {self.gen} (id, g) VALUES (:k, 1) ON DUPLICATE KEY UPDATE g = g + 1"), args)
        args["n"] = conn.execute(sa.text(f"SELECT g FROM {self.gen} WHERE id = :k"), args).scalar_one()
        if op == "upsert":
            upsert = f"INSERT INTO {self.table} (id, v, n) VALUES (:k, :v, :n) ON DUPLICATE KEY UPDATE v = :v, n = :n"
            conn.execute(sa.text(upsert), args)
            return
        conn.execute(sa.text(f"UPDATE {self.table} SET v = :v, n = :n WHERE id = :k"), args)
        if op == "delete":
            conn.execute(sa.text(f"DELETE FROM {self.table} WHERE id = :k"), args)


def stale_or_resurrected(events: Sequence[RowChange]) -> list[tuple[Any, ...]]:
    """Snapshot rows older than a change of their key delivered before them (``n``: the versions
    :class:`Versions` writes; rows that predate the writes have 0).

    In delivery order a key's versions must never go back, and a read after a delete must be of a
    row written after it (a higher version).
    """
    last: dict[Any, tuple[int, bool]] = {}  # key -> (version, deleted)
    bad: list[tuple[Any, ...]] = []
    for e in events:
        image = e.before if e.change == "delete" else e.after
        assert image is not None
        version, key = int(image["n"]), e.pk["id"]
        seen = last.get(key)
        if e.change == "read" and seen is not None and (version < seen[0] or (seen[1] and version <= seen[0])):
            bad.append((key, e.change, version, seen))
        last[key] = (max(version, seen[0]) if seen else version, e.change == "delete")
    return bad


def binlog_here(config: PollerConfig) -> BinlogPosition:
    """The binlog's end now (with MariaDB's GTID state): where a stream opened now would start."""
    source = MysqlBinlogSource(config)
    try:
        start = source.fetch(None, 1).advance
    finally:
        source.close()
    assert start is not None
    return BinlogPosition.from_position(start)


def binlog_changes(config: PollerConfig, start: BinlogPosition, tables: set[str]) -> list[BinlogChange]:
    """Every change of ``tables`` in the binlog from ``start`` to its end now, in binlog order."""
    engine = sa.create_engine(config.source_url)
    try:
        with engine.connect() as conn:
            file, pos = conn.execute(sa.text("SHOW MASTER STATUS")).one()[:2]
        _args, kwargs = engine.dialect.create_connect_args(engine.url)
    finally:
        engine.dispose()
    kwargs.pop("client_flag", None)
    reader = BinlogReader(
        {**kwargs, "connect_timeout": 10}, config.server_id, frozenset(tables), start, (str(file), int(pos)),
        by_gtid=start.gtid_state is not None,
    )  # fmt: skip
    out: list[BinlogChange] = []
    try:
        while not reader.at_end:
            out.extend(reader.read(1000))
    finally:
        reader.close()
    return out
