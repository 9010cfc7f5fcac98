"""The keyset source on SQLite, PostgreSQL and MariaDB: one behaviour per test, every dialect."""

from __future__ import annotations

import datetime as dt
import logging
import random
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa

from poller.sources.keyset.source import SqlSource
from shared.codec import decode_position, encode_position
from shared.errors import ConfigError, CursorError, FetchError, SourceError
from tests.poller.source_fixtures import UTC, create, drain, engine, pks, poller_config, timestamp
from tests.support.databases import unique_name

__all__ = ["engine"]  # the fixture, re-exported for pytest

pytestmark = pytest.mark.integration


def _tied_rows(n: int, ties: int, seed: int = 7) -> list[dict[str, Any]]:
    rows = [{"id": i, "c": i // ties, "note": f"r{i}"} for i in range(1, n + 1)]
    random.Random(seed).shuffle(rows)  # insertion order must not matter
    return rows


def _int_table(engine: sa.Engine, rows: Sequence[dict[str, Any]], **extra: sa.Column[Any]) -> str:
    name = unique_name()
    create(
        engine,
        name,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("c", sa.BigInteger, nullable=True),
        sa.Column("note", sa.String(20)),
        *extra.values(),
        sa.Index(f"ix_{name}", "c", "id"),
        rows=rows,
    )
    return name


def test_pages_deliver_every_row_once_in_cursor_then_pk_order_across_ties(engine: sa.Engine) -> None:
    # Given 250 rows whose cursor values come in runs of 7 ties, inserted in random order
    rows = _tied_rows(250, ties=7)
    source = SqlSource(poller_config(str(engine.url), table=_int_table(engine, rows)), engine)
    # When paging with a batch size that splits every run of ties
    delivered = drain(source, limit=5)
    # Then each row comes exactly once, in (cursor, pk) order
    expected = sorted(rows, key=lambda r: (r["c"], r["id"]))
    assert pks(delivered) == [r["id"] for r in expected]
    assert delivered[0].values["note"] == expected[0]["note"]


def test_composite_pk_breaks_cursor_ties_lexicographically(engine: sa.Engine) -> None:
    # Given a (tenant, seq) primary key and only three cursor values
    rows = [{"tenant": t, "seq": s, "c": (t * s) % 3} for t in range(1, 6) for s in range(1, 8)]
    random.Random(3).shuffle(rows)
    name = unique_name()
    create(
        engine,
        name,
        sa.Column("tenant", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("c", sa.Integer, nullable=False),
        sa.Index(f"ix_{name}", "c", "tenant", "seq"),
        rows=rows,
    )
    source = SqlSource(poller_config(str(engine.url), table=name, pk=("tenant", "seq")), engine)
    # When paging 4 at a time
    delivered = drain(source, limit=4)
    # Then the order is (c, tenant, seq) and nothing repeats or goes missing
    expected = sorted((r["c"], r["tenant"], r["seq"]) for r in rows)
    assert [(r.cursor, *pks([r], "tenant", "seq")[0]) for r in delivered] == expected


def test_filter_is_anded_to_the_keyset_predicate(engine: sa.Engine) -> None:
    rows = _tied_rows(40, ties=3)
    table = _int_table(engine, rows)
    # Given a filter with an OR (it must be parenthesised to not escape the predicate)
    cfg = poller_config(str(engine.url), table=table, filter="id < 10 OR id > 35")
    delivered = drain(SqlSource(cfg, engine), limit=3)
    assert sorted(pks(delivered)) == [*range(1, 10), *range(36, 41)]


def test_soft_deleted_rows_are_marked_deleted_and_keep_the_column(engine: sa.Engine) -> None:
    name = unique_name()
    create(
        engine,
        name,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("c", sa.Integer, nullable=False),
        sa.Column("deleted_at", timestamp(aware=False), nullable=True),
        sa.Column("is_gone", sa.Boolean, nullable=False),
        rows=[
            {"id": 1, "c": 1, "deleted_at": None, "is_gone": False},
            {"id": 2, "c": 2, "deleted_at": dt.datetime(2026, 1, 1, 9), "is_gone": True},
        ],
    )
    by_time = drain(SqlSource(poller_config(str(engine.url), table=name, soft_delete_column="deleted_at"), engine), 10)
    by_flag = drain(SqlSource(poller_config(str(engine.url), table=name, soft_delete_column="is_gone"), engine), 10)
    assert [r.deleted for r in by_time] == [False, True]
    assert [r.deleted for r in by_flag] == [False, True]
    assert by_time[1].values["deleted_at"] == dt.datetime(2026, 1, 1, 9)


def test_null_cursor_rows_are_skipped_counted_and_never_wedge(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    # Given rows with a NULL cursor among ordinary ones (null_cursor = "skip", the default)
    rows = [{"id": i, "c": None if i % 4 == 0 else i, "note": ""} for i in range(1, 13)]
    source = SqlSource(poller_config(str(engine.url), table=_int_table(engine, rows)), engine)
    # When the poller drains the table
    with caplog.at_level(logging.WARNING, logger="dbfanout"):
        page = source.fetch(None, 100)
    # Then every non-NULL row arrives, the NULL ones are counted and named in a WARNING
    assert pks(page.rows) == [i for i in range(1, 13) if i % 4]
    assert page.skipped_null_cursors == 3
    assert any("3 row(s) with a NULL c" in m and "orders" in m for m in caplog.messages)
    assert source.fetch(page.last, 100).rows == []  # caught up, not stuck


def test_null_cursor_fail_policy_raises_a_cursor_error_naming_the_column(engine: sa.Engine) -> None:
    rows: list[dict[str, Any]] = [{"id": 1, "c": 5, "note": ""}, {"id": 2, "c": None, "note": ""}]
    source = SqlSource(poller_config(str(engine.url), table=_int_table(engine, rows), null_cursor="fail"), engine)
    with pytest.raises(CursorError, match=r"1 row\(s\) have a NULL in cursor column 'c'") as err:
        source.fetch(None, 10)
    assert "null_cursor" in err.value.hint


def _naive_table(engine: sa.Engine) -> str:
    name = unique_name()
    base = dt.datetime(2026, 3, 1, 12, 0, 0, 250)
    create(
        engine,
        name,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("c", timestamp(aware=False), nullable=False),
        rows=[{"id": i, "c": base + dt.timedelta(seconds=i // 3)} for i in range(1, 10)],
    )
    return name


def test_naive_timestamp_cursor_is_rejected_without_cursor_timezone(engine: sa.Engine) -> None:
    source = SqlSource(poller_config(str(engine.url), table=_naive_table(engine)), engine)
    with pytest.raises(CursorError, match="without a time zone") as err:
        source.fetch(None, 10)
    assert "cursor_timezone" in err.value.hint


def test_naive_timestamp_with_cursor_timezone_is_delivered_tz_aware_and_resumes_from_a_stored_checkpoint(
    engine: sa.Engine,
) -> None:
    cfg = poller_config(str(engine.url), table=_naive_table(engine), cursor_timezone="UTC")
    first = SqlSource(cfg, engine).fetch(None, 4)
    # Then the event value is tz-aware while the checkpoint keeps what the database compares
    assert first.rows[0].values["c"] == dt.datetime(2026, 3, 1, 12, 0, 0, 250, tzinfo=UTC)
    # When the checkpoint goes through the state blob codec and a new process resumes from it
    resumed_at = decode_position(encode_position(first.last))
    rest = drain(SqlSource(cfg, engine), limit=2, after=resumed_at)
    # Then it continues right after the tie it stopped in
    assert pks(first.rows) + pks(rest) == list(range(1, 10))


def test_decimal_cursor_round_trips_through_the_checkpoint(engine: sa.Engine) -> None:
    name = unique_name()
    create(
        engine,
        name,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("c", sa.Numeric(30, 6), nullable=False),
        rows=[{"id": i, "c": Decimal("12345678901234.000001") + i // 2} for i in range(1, 8)],
    )
    cfg = poller_config(str(engine.url), table=name)
    page = SqlSource(cfg, engine).fetch(None, 3)
    after = decode_position(encode_position(page.last))
    rest = drain(SqlSource(cfg, engine), 3, after=after)
    assert pks(page.rows) + pks(rest) == list(range(1, 8))


def test_missing_table_is_a_config_error_naming_the_table_key(engine: sa.Engine) -> None:
    source = SqlSource(poller_config(str(engine.url), table="no_such_table_here"), engine)
    with pytest.raises(ConfigError, match=r"pollers\.orders\.table") as err:
        source.fetch(None, 10)
    assert "no_such_table_here" in str(err.value)


def test_missing_cursor_column_names_the_key_and_the_columns_that_exist(engine: sa.Engine) -> None:
    table = _int_table(engine, [])
    with pytest.raises(ConfigError, match=r"pollers.orders.cursor: column 'updated_at' .* \(it has: id, c, note\)"):
        SqlSource(poller_config(str(engine.url), table=table, cursor="updated_at"), engine).fetch(None, 1)
    with pytest.raises(ConfigError, match=r"pollers\.orders\.soft_delete_column"):
        SqlSource(poller_config(str(engine.url), table=table, soft_delete_column="gone"), engine).fetch(None, 1)


def test_query_mode_pages_through_the_users_select(engine: sa.Engine) -> None:
    rows = _tied_rows(30, ties=4)
    table = _int_table(engine, rows)
    query = f"SELECT id, c, note, id * 2 AS doubled FROM {table} WHERE id <= 20"
    delivered = drain(SqlSource(poller_config(str(engine.url), query=query), engine), limit=3)
    assert sorted(pks(delivered)) == list(range(1, 21))
    assert pks(delivered) == [r["id"] for r in sorted(rows, key=lambda r: (r["c"], r["id"])) if r["id"] <= 20]
    assert all(r.values["doubled"] == r.values["id"] * 2 for r in delivered)


def test_query_mode_without_the_cursor_in_its_output_is_a_config_error(engine: sa.Engine) -> None:
    table = _int_table(engine, _tied_rows(3, ties=1))
    source = SqlSource(poller_config(str(engine.url), query=f"SELECT id, note FROM {table}"), engine)
    with pytest.raises(ConfigError, match=r"pollers.orders.cursor: column 'c' is not in the query's output"):
        source.fetch(None, 10)


def test_bad_sql_in_the_filter_is_a_source_error_not_a_retryable_one(engine: sa.Engine) -> None:
    table = _int_table(engine, _tied_rows(3, ties=1))
    source = SqlSource(poller_config(str(engine.url), table=table, filter="no_such_column > 1"), engine)
    with pytest.raises(SourceError) as err:
        source.fetch(None, 10)
    assert not isinstance(err.value, FetchError) and not err.value.retryable


def test_database_down_is_a_retryable_fetch_error_without_the_password(any_db_url: str) -> None:
    if any_db_url.startswith("sqlite"):
        url = "sqlite:////nonexistent-dir/for/sure/db.sqlite"
    else:
        url = sa.make_url(any_db_url).set(host="127.0.0.1", port=1, password="s3cret-pw").render_as_string(False)
    with pytest.raises(FetchError) as err:
        SqlSource(poller_config(url)).fetch(None, 10)
    assert err.value.retryable
    assert "s3cret-pw" not in str(err.value)
    assert isinstance(err.value.__cause__, sa.exc.DBAPIError)


def test_settle_window_hides_rows_younger_than_the_window_on_the_database_clock(engine: sa.Engine) -> None:
    # Given one row an hour old and one stamped with the database's own current time
    name = unique_name()
    table = create(
        engine,
        name,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("c", timestamp(aware=engine.dialect.name == "postgresql"), nullable=False),
    )
    now = {"postgresql": "now()", "sqlite": "strftime('%Y-%m-%d %H:%M:%f','now')"}.get(
        engine.dialect.name, "UTC_TIMESTAMP(6)"
    )
    with engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {name} (id, c) VALUES (2, {now})"))
        hour_ago = conn.execute(sa.select(table.c.c)).scalar_one() - dt.timedelta(hours=1)
        conn.execute(table.insert(), [{"id": 1, "c": hour_ago}])
    cfg = poller_config(str(engine.url), table=name, settle_seconds=30, cursor_timezone="UTC")
    # When fetching with a 30 s settle window
    page = SqlSource(cfg, engine).fetch(None, 10)
    # Then only the settled row is read; without the window both are
    assert pks(page.rows) == [1]
    unsettled = SqlSource(poller_config(str(engine.url), table=name, cursor_timezone="UTC"), engine)
    assert pks(unsettled.fetch(None, 10).rows) == [1, 2]


def test_pinned_fetches_share_one_connection_and_each_page_sees_rows_committed_meanwhile(
    engine: sa.Engine,
) -> None:
    # Given 10 rows, and a count of pool checkouts made by fetches
    name = _int_table(engine, [{"id": i, "c": i, "note": "r"} for i in range(1, 11)])
    source = SqlSource(poller_config(str(engine.url), table=name), engine)
    checkouts: list[int] = []
    listener = lambda *args: checkouts.append(1)  # noqa: E731
    sa.event.listen(engine, "checkout", listener)
    try:

        def fetch_counted(after: Any, limit: int) -> tuple[Any, int]:
            before = len(checkouts)
            page = source.fetch(after, limit)
            return page, len(checkouts) - before

        with source.pinned():
            page, first = fetch_counted(None, 5)
            # When another session commits a row between two pages (REPEATABLE READ on MariaDB
            # would hide it from a transaction left open)
            with engine.begin() as conn:
                conn.execute(sa.text(f"INSERT INTO {name} (id, c, note) VALUES (11, 11, 'late')"))
            rest, second = fetch_counted(page.last, 100)
        # Then one checkout served both pages, and the second page saw the new row
        assert (first, second) == (1, 0)
        assert pks(page.rows) + pks(rest.rows) == list(range(1, 12))
        # And unpinned, every fetch checks a connection out (and pings it)
        assert [fetch_counted(None, 5)[1] for _ in range(2)] == [1, 1]
    finally:
        sa.event.remove(engine, "checkout", listener)
