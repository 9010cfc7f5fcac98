"""SQLite specifics of the keyset source: datetimes stored as TEXT, engines, fingerprints, warnings."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from poller.ports import SourceRow
from poller.sources.engines import dispose_engines, make_engine
from poller.sources.keyset.source import SqlSource
from shared.codec import decode_position, encode_position
from shared.errors import ConfigError, CursorError
from shared.models import Position
from tests.poller.source_fixtures import UTC, drain, pks, poller_config

# Text as other writers store it: no micros, micros, a 'T' separator (all in one second)
MIXED_PRECISION = [
    (1, "2026-01-01 10:00:00"),
    (2, "2026-01-01 10:00:00"),
    (3, "2026-01-01 10:00:00"),
    (4, "2026-01-01 10:00:00"),
    (5, "2026-01-01 10:00:00.000001"),
    (6, "2026-01-01 10:00:00.5"),
    (7, "2026-01-01 10:00:01"),
]


@pytest.fixture
def db(sqlite_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(sqlite_url)
    yield engine
    engine.dispose()


def _datetime_table(db: sa.Engine, rows: list[tuple[int, str]], *, index: bool = True) -> sa.Table:
    table = sa.Table(
        "t",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("c", sa.DateTime, nullable=True),
        sa.Column("note", sa.String),
    )
    with db.begin() as conn:
        table.create(conn)
        if index:
            conn.exec_driver_sql("CREATE INDEX ix_t_c_id ON t (c, id)")
        for pk, text in rows:  # raw text, exactly as another application wrote it
            conn.exec_driver_sql("INSERT INTO t (id, c, note) VALUES (?, ?, ?)", (pk, text, f"n{pk}"))
    return table


def test_competitors_bound_datetime_skips_tied_rows_stored_without_micros(db: sa.Engine) -> None:
    # Given rows sharing one timestamp, stored as text without microseconds
    table = _datetime_table(db, MIXED_PRECISION)
    # When a poller checkpoints (10:00:00, id 2) as a datetime and binds it back (the competitor's way)
    checkpoint = dt.datetime(2026, 1, 1, 10, 0, 0)
    naive_keyset = sa.or_(table.c.c > checkpoint, sa.and_(table.c.c == checkpoint, table.c.id > 2))
    with db.connect() as conn:
        seen = conn.execute(sa.select(table.c.id).where(naive_keyset).order_by(table.c.c, table.c.id)).scalars().all()
    # Then ids 3 and 4 are lost: '10:00:00' neither equals nor exceeds '10:00:00.000000' as text
    assert 3 not in seen and 4 not in seen


def test_mixed_precision_text_timestamps_are_all_delivered_across_batch_boundaries(db: sa.Engine) -> None:
    _datetime_table(db, MIXED_PRECISION)
    cfg = poller_config(str(db.url), cursor_timezone="UTC")
    # When paging two rows at a time (so a boundary falls inside the tie), resuming each page from a
    # checkpoint that went through the state blob codec, as a new process would
    delivered: list[SourceRow] = []
    after = None
    while page := SqlSource(cfg, db).fetch(after, 2).rows:
        delivered.extend(page)
        after = decode_position(encode_position(page[-1].position))
    # Then every row arrives once, in stored order
    assert pks(delivered) == [1, 2, 3, 4, 5, 6, 7]


def test_position_keeps_the_stored_text_and_the_event_gets_a_tz_aware_datetime(db: sa.Engine) -> None:
    _datetime_table(db, [(1, "2026-01-01 10:00:00"), (2, "2026-01-01T10:00:00.250000")])
    rows = SqlSource(poller_config(str(db.url), cursor_timezone="Europe/Paris"), db).fetch(None, 1).rows
    assert rows[0].position == Position("2026-01-01 10:00:00", {"id": 1})
    assert rows[0].values["c"] == dt.datetime(2026, 1, 1, 9, 0, tzinfo=UTC)
    assert rows[0].values["c"].utcoffset() == dt.timedelta(hours=1)


def test_naive_text_timestamps_need_cursor_timezone(db: sa.Engine) -> None:
    _datetime_table(db, [(1, "2026-01-01 10:00:00")])
    with pytest.raises(CursorError, match="without a time zone"):
        SqlSource(poller_config(str(db.url)), db).fetch(None, 10)


def test_text_timestamps_with_utc_offsets_need_no_cursor_timezone(db: sa.Engine) -> None:
    _datetime_table(db, [(1, "2026-01-01 10:00:00+00:00"), (2, "2026-01-01 10:00:01+00:00")])
    rows = drain(SqlSource(poller_config(str(db.url)), db), 1)
    assert [r.values["c"] for r in rows] == [dt.datetime(2026, 1, 1, 10, 0, s, tzinfo=UTC) for s in (0, 1)]


def test_settle_window_uses_the_stored_t_separator(db: sa.Engine) -> None:
    # Given 'T'-separated text: one row an hour old, one stamped now by SQLite's clock
    _datetime_table(db, [])
    with db.begin() as conn:
        conn.exec_driver_sql("INSERT INTO t VALUES (1, strftime('%Y-%m-%dT%H:%M:%f', 'now', '-1 hour'), '')")
        conn.exec_driver_sql("INSERT INTO t VALUES (2, strftime('%Y-%m-%dT%H:%M:%f', 'now'), '')")
    # When fetching with a 30 s settle window
    rows = SqlSource(poller_config(str(db.url), cursor_timezone="UTC", settle_seconds=30), db).fetch(None, 10).rows
    # Then the old row is read (a ' '-formatted bound would sort below every 'T' value of the day)
    assert pks(rows) == [1]


def test_mixing_text_formats_is_warned_once(db: sa.Engine, caplog: pytest.LogCaptureFixture) -> None:
    _datetime_table(db, [(1, "2026-01-01 10:00:00"), (2, "2026-01-01T10:00:01"), (3, "2026-01-01T10:00:02")])
    with caplog.at_level(logging.WARNING, logger="dbfanout"):
        drain(SqlSource(poller_config(str(db.url), cursor_timezone="UTC"), db), 10)
    assert sum("mixes text formats" in m for m in caplog.messages) == 1


def test_query_mode_recognises_text_timestamps(db: sa.Engine) -> None:
    _datetime_table(db, MIXED_PRECISION)
    cfg = poller_config(str(db.url), query="SELECT id, c FROM t", cursor_timezone="UTC")
    rows = drain(SqlSource(cfg, db), 3)
    assert pks(rows) == [1, 2, 3, 4, 5, 6, 7]
    assert rows[0].values["c"] == dt.datetime(2026, 1, 1, 10, tzinfo=UTC)
    assert rows[0].cursor == "2026-01-01 10:00:00"


def test_schema_qualified_table_names_are_reflected(db: sa.Engine) -> None:
    _datetime_table(db, MIXED_PRECISION[:2])
    assert pks(drain(SqlSource(poller_config(str(db.url), table="main.t", cursor_timezone="UTC"), db), 5)) == [1, 2]


def test_an_empty_table_returns_empty_pages_until_rows_arrive(db: sa.Engine) -> None:
    _datetime_table(db, [])
    source = SqlSource(poller_config(str(db.url), cursor_timezone="UTC"), db)
    assert source.fetch(None, 10).rows == []
    with db.begin() as conn:
        conn.exec_driver_sql("INSERT INTO t VALUES (1, '2026-01-01 10:00:00', '')")
    assert pks(source.fetch(None, 10).rows) == [1]


def test_missing_index_on_cursor_and_pk_is_warned_and_described(
    db: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    _datetime_table(db, MIXED_PRECISION, index=False)
    source = SqlSource(poller_config(str(db.url), cursor_timezone="UTC"), db)
    with caplog.at_level(logging.WARNING, logger="dbfanout"):
        info = source.describe()
    assert "CREATE INDEX ix_t_dbfanout ON t (c, id)" in (source.index_warning() or "")
    assert info["index_warning"] == source.index_warning()
    assert any("no index on t starts with (c, id)" in m for m in caplog.messages)
    assert info["cursor_kind"] == "text_datetime" and info["predicate"] == "expanded"


def test_an_index_led_by_cursor_and_pk_satisfies_the_check(db: sa.Engine) -> None:
    _datetime_table(db, MIXED_PRECISION)
    source = SqlSource(poller_config(str(db.url), cursor_timezone="UTC"), db)
    assert source.describe()["index_warning"] is None


def test_float_cursors_and_unsettleable_integer_cursors_are_warned_once(
    db: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    with db.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE f (id INTEGER PRIMARY KEY, c REAL, n INTEGER)")
        conn.exec_driver_sql("INSERT INTO f VALUES (1, 0.5, 1), (2, 1.5, 2)")
    with caplog.at_level(logging.WARNING, logger="dbfanout"):
        floats = SqlSource(poller_config(str(db.url), table="f"), db)
        drain(floats, 1)
        ints = SqlSource(poller_config(str(db.url), table="f", cursor="n", settle_seconds=2), db)
        drain(ints, 1)
    assert sum("is a float" in m for m in caplog.messages) == 1
    assert sum("settle_seconds does not apply to the number cursor 'n'" in m for m in caplog.messages) == 1
    assert "single writer" in ints.describe()["settle"]


def test_boolean_cursor_is_rejected(db: sa.Engine) -> None:
    with db.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE b (id INTEGER PRIMARY KEY, c BOOLEAN)")
        conn.exec_driver_sql("INSERT INTO b VALUES (1, 1)")
    with pytest.raises(CursorError, match="boolean"):
        SqlSource(poller_config(str(db.url), table="b"), db).fetch(None, 1)


def test_xid_horizon_outside_postgresql_is_a_config_error(db: sa.Engine) -> None:
    with pytest.raises(ConfigError, match=r"xid_column: needs PostgreSQL"):
        SqlSource(poller_config(str(db.url), xid_column="txid"), db)


def test_unknown_cursor_timezone_is_a_config_error(db: sa.Engine) -> None:
    with pytest.raises(ConfigError, match="cursor_timezone: unknown time zone"):
        SqlSource(poller_config(str(db.url), cursor_timezone="Mars/Olympus"), db)


def test_checkpoint_naming_another_pk_is_a_cursor_error(db: sa.Engine) -> None:
    _datetime_table(db, MIXED_PRECISION)
    source = SqlSource(poller_config(str(db.url), cursor_timezone="UTC"), db)
    with pytest.raises(CursorError, match="tiebreaker"):
        source.fetch(Position("2026-01-01 10:00:00", {"order_id": 1}), 10)


def test_fingerprint_is_stable_and_never_contains_the_password() -> None:
    url = "postgresql+psycopg://app:hunter2@db.example/shop"
    a = SqlSource(poller_config(url), sa.create_engine("sqlite://"))
    b = SqlSource(poller_config(url), sa.create_engine("sqlite://"))
    other_pw = SqlSource(poller_config(url.replace("hunter2", "rotated")), sa.create_engine("sqlite://"))
    filtered = SqlSource(poller_config(url, filter="region = 'eu'"), sa.create_engine("sqlite://"))
    # Then: same definition -> same hash (also across password rotation); the filter is part of it
    assert a.fingerprint == b.fingerprint == other_pw.fingerprint
    assert filtered.fingerprint != a.fingerprint
    assert a.fingerprint.startswith("sha256:") and "hunter2" not in a.fingerprint


def test_engines_are_pooled_per_url_and_disposed_on_shutdown(sqlite_url: str) -> None:
    first = make_engine(sqlite_url)
    assert make_engine(sqlite_url) is first
    assert first.pool._pre_ping
    dispose_engines()
    assert make_engine(sqlite_url) is not first
    dispose_engines()
