"""Helpers shared by the keyset source tests (imported, not a conftest)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql

from poller.ports import SourceRow
from poller.sources.keyset.source import SqlSource
from shared.config import PollerConfig
from shared.models import Position

UTC = dt.UTC
_CREATED: dict[int, list[sa.MetaData]] = {}


def poller_config(url: str, **overrides: Any) -> PollerConfig:
    """A poller config for tests: table ``t``, cursor ``c``, pk ``id``, settle disabled."""
    values: dict[str, Any] = {
        "name": "orders",
        "source_url": url,
        "cursor": "c",
        "pk": ("id",),
        "queue": "orders-changes",
        "table": "t",
        "settle_seconds": 0.0,
    }
    values.update(overrides)
    if "query" in overrides and "table" not in overrides:
        values["table"] = None
    return PollerConfig(**values)


def drain(source: SqlSource, limit: int, after: Position | None = None, max_pages: int = 100_000) -> list[SourceRow]:
    """Every row the source delivers, paging with ``limit`` until an empty page."""
    rows: list[SourceRow] = []
    for _ in range(max_pages):
        page = source.fetch(after, limit)
        assert len(page.rows) <= limit
        if not page.rows:
            return rows
        rows.extend(page.rows)
        after = page.last
    raise AssertionError("source never caught up")


def pks(rows: Sequence[SourceRow], *names: str) -> list[Any]:
    names = names or ("id",)
    if len(names) == 1:
        return [r.position.pk[names[0]] for r in rows]
    return [tuple(r.position.pk[n] for n in names) for r in rows]


def timestamp(aware: bool) -> sa.types.TypeEngine[Any]:
    """A microsecond timestamp column type on every dialect (MariaDB needs DATETIME(6))."""
    return (
        sa.DateTime(timezone=aware)
        .with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
        .with_variant(postgresql.TIMESTAMP(timezone=aware, precision=6), "postgresql")
    )


@pytest.fixture
def engine(any_db_url: str) -> Iterator[sa.Engine]:
    """A test-owned engine on the parametrised database (tables are dropped afterwards)."""
    eng = sa.create_engine(any_db_url)
    _CREATED[id(eng)] = []
    yield eng
    for md in _CREATED.pop(id(eng)):
        md.drop_all(eng)
    eng.dispose()


def create(
    engine: sa.Engine, name: str, *columns: sa.schema.SchemaItem, rows: Sequence[dict[str, Any]] = ()
) -> sa.Table:
    """Create a table (dropped at teardown when made through the ``engine`` fixture) and insert rows."""
    md = sa.MetaData()
    table = sa.Table(name, md, *columns)
    md.create_all(engine)
    if id(engine) in _CREATED:
        _CREATED[id(engine)].append(md)
    if rows:
        with engine.begin() as conn:
            conn.execute(table.insert(), list(rows))
    return table
