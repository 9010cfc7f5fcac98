"""The production keyset SELECT seeks the (cursor, pk) index on every dialect: shown with EXPLAIN.

Each test asks the source for the exact statement and parameters a fetch after a checkpoint runs
(``SqlSource.keyset_query``), with the settle window on, and reads the database's own plan.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from poller.sources.keyset.source import SqlSource
from shared.models import Position
from tests.poller.source_fixtures import poller_config
from tests.support.databases import unique_name

ROWS = 20_000


def _explain(conn: sa.Connection, prefix: str, stmt: sa.Select[Any], params: dict[str, Any]) -> str:
    compiled = stmt.compile(dialect=conn.dialect)
    bound = compiled.construct_params(params)
    args: Any = tuple(bound[n] for n in compiled.positiontup) if compiled.positiontup else bound
    plan = "\n".join(" | ".join(str(v) for v in row) for row in conn.exec_driver_sql(prefix + str(compiled), args))
    print(plan)  # shown with -s or on failure
    return plan


def _query(source: SqlSource, after: Position) -> tuple[sa.Select[Any], dict[str, Any]]:
    planned = source.keyset_query(after, 1000)
    assert planned is not None
    return planned


@pytest.fixture
def pg(pg_url: str) -> Iterator[tuple[sa.Engine, str]]:
    engine = sa.create_engine(pg_url)
    name = unique_name()
    yield engine, name
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
    engine.dispose()


def test_sqlite_fetch_after_a_checkpoint_searches_the_index_without_sorting(sqlite_url: str) -> None:
    # Given a text-timestamp table with a (c, id) index and many ties
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (id INTEGER PRIMARY KEY, c DATETIME, pad TEXT)")
        conn.exec_driver_sql("CREATE INDEX ix_t_c_id ON t (c, id)")
        conn.exec_driver_sql(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
            "INSERT INTO t SELECT i, strftime('%Y-%m-%d %H:%M:%f', '2026-01-01', (i / 10) || ' seconds'), 'x' FROM n",
            (ROWS,),
        )
        conn.exec_driver_sql("ANALYZE")
    source = SqlSource(poller_config(sqlite_url, cursor_timezone="UTC", settle_seconds=2), engine)
    stmt, params = _query(source, Position("2026-01-01 00:10:00.000", {"id": 6000}))
    # When SQLite plans the fetch
    with engine.connect() as conn:
        plan = _explain(conn, "EXPLAIN QUERY PLAN ", stmt, params)
    engine.dispose()
    # Then it is a range search on the index, in index order (no temp b-tree sort)
    assert "SEARCH t USING INDEX ix_t_c_id (c>? AND c<?)" in plan, plan
    assert "TEMP B-TREE" not in plan, plan


def test_postgresql_fetch_after_a_checkpoint_is_an_index_scan_on_the_row_value(pg: tuple[sa.Engine, str]) -> None:
    engine, name = pg
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {name} (id bigint PRIMARY KEY, c timestamptz NOT NULL, pad text)")
        conn.exec_driver_sql(f"CREATE INDEX ix_{name} ON {name} (c, id)")
        conn.exec_driver_sql(
            f"INSERT INTO {name} SELECT i, timestamptz '2026-01-01 00:00:00+00' + (i / 10) * interval '1 second', "
            f"repeat('x', 50) FROM generate_series(1, {ROWS}) AS i"
        )
        conn.exec_driver_sql(f"ANALYZE {name}")
    source = SqlSource(poller_config(str(engine.url), table=name, settle_seconds=2), engine)
    checkpoint = dt.datetime(2026, 1, 1, 0, 10, tzinfo=dt.UTC)
    stmt, params = _query(source, Position(checkpoint, {"id": 6000}))
    with engine.connect() as conn:
        plan = _explain(conn, "EXPLAIN ", stmt, params)
    # The row-value comparison and the settle bound are both index conditions: a seek, no sort
    assert f"Index Scan using ix_{name}" in plan, plan
    assert "Index Cond: ((ROW(c, id) > ROW(" in plan and "(c <= (now() - " in plan, plan
    assert "Sort" not in plan and "Seq Scan" not in plan, plan


def test_postgresql_composite_pk_seeks_with_one_row_value(pg: tuple[sa.Engine, str]) -> None:
    engine, name = pg
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {name} (a int, b int, c bigint NOT NULL, PRIMARY KEY (a, b))")
        conn.exec_driver_sql(f"CREATE INDEX ix_{name} ON {name} (c, a, b)")
        conn.exec_driver_sql(f"INSERT INTO {name} SELECT mod(i, 97), i, i / 10 FROM generate_series(1, {ROWS}) AS i")
        conn.exec_driver_sql(f"ANALYZE {name}")
    source = SqlSource(poller_config(str(engine.url), table=name, pk=("a", "b")), engine)
    stmt, params = _query(source, Position(600, {"a": 3, "b": 6003}))
    with engine.connect() as conn:
        plan = _explain(conn, "EXPLAIN ", stmt, params)
    assert f"Scan using ix_{name}" in plan and "Index Cond: (ROW(c, a, b) > ROW(" in plan, plan


def test_mariadb_fetch_after_a_checkpoint_is_a_range_scan_on_the_index(mysql_url: str) -> None:
    engine = sa.create_engine(mysql_url)
    name = unique_name()
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                f"CREATE TABLE {name} (id INT PRIMARY KEY, c DATETIME(6) NOT NULL, pad VARCHAR(60), "
                f"INDEX ix_{name} (c, id))"
            )
            conn.exec_driver_sql(
                f"INSERT INTO {name} SELECT seq, '2026-01-01' + INTERVAL (seq DIV 10) SECOND, REPEAT('x', 50) "
                f"FROM seq_1_to_{ROWS}"
            )
            conn.exec_driver_sql(f"ANALYZE TABLE {name}")
        source = SqlSource(poller_config(mysql_url, table=name, cursor_timezone="UTC", settle_seconds=2), engine)
        stmt, params = _query(source, Position(dt.datetime(2026, 1, 1, 0, 30), {"id": 18000}))
        with engine.connect() as conn:
            plan = _explain(conn, "EXPLAIN ", stmt, params)
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
        engine.dispose()
    # (A row-value predicate would be type ALL + filesort here; the expanded form is a range.)
    assert f"range | PRIMARY,ix_{name} | ix_{name}" in plan, plan
    assert "filesort" not in plan, plan
