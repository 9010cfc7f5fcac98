"""fetch_tuples: the driver's rows with SQLAlchemy's type processors gives what ``Result.all()`` gives."""

from __future__ import annotations

import datetime as dt
import decimal
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from poller.sql import fetch_tuples


def _typed_table(name: str) -> sa.Table:
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("amount", sa.Numeric(12, 2)),
        sa.Column("ratio", sa.Float),
        sa.Column("at", sa.DateTime(timezone=True)),
        sa.Column("day", sa.Date),
        sa.Column("flag", sa.Boolean),
        sa.Column("label", sa.String(40)),
        sa.Column("blob", sa.LargeBinary),
    )


def test_fetch_tuples_equals_result_all_on_every_dialect(
    any_db_url: str, engine_for: Callable[[str], sa.Engine]
) -> None:
    engine = engine_for(any_db_url)
    table = _typed_table(f"fetch_{uuid.uuid4().hex[:8]}")
    table.create(engine)
    try:
        rows: list[dict[str, Any]] = [
            {
                "id": i,
                "amount": decimal.Decimal(f"{i}.{i % 100:02d}") if i % 7 else None,
                "ratio": i / 3 if i % 5 else None,
                "at": dt.datetime(2026, 11, 23, 10, 0, i % 60, tzinfo=dt.UTC) if i % 6 else None,
                "day": dt.date(2026, 1 + i % 12, 1 + i % 28) if i % 4 else None,
                "flag": bool(i % 2) if i % 3 else None,
                "label": f"row {i}" if i % 9 else None,
                "blob": bytes([i % 256]) * 3 if i % 8 else None,
            }
            for i in range(1, 200)
        ]
        with engine.begin() as conn:
            conn.execute(table.insert(), rows)
        query = sa.select(table).order_by(table.c.id)
        with engine.connect() as conn:
            expected = [tuple(r) for r in conn.execute(query).all()]
            got = [tuple(r) for r in fetch_tuples(conn.execute(query))]
            # the connection is usable afterwards (the result was closed)
            assert conn.execute(sa.select(sa.func.count()).select_from(table)).scalar() == len(rows)
        assert got == expected
        assert [type(v) for v in got[10]] == [type(v) for v in expected[10]]
        with engine.connect() as conn:
            assert list(fetch_tuples(conn.execute(query.where(table.c.id < 0)))) == []
    finally:
        table.drop(engine)
