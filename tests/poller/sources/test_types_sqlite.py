"""Every SQLite storage class and declared type arrives as stored through keyset (issue 42).

SQLite keeps any value in any column: a DATE column may hold '2024-02-30', a DECIMAL(10,2) column
12.345. Such values never stop the poller, and a number arrives as the number stored.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poller.sources.keyset.source import SqlSource
from poller.tick.events import page_batch
from shared import codec
from tests.poller.source_fixtures import poller_config

COLUMNS = (
    "id INTEGER PRIMARY KEY, c INTEGER NOT NULL, i INTEGER, r REAL, tx TEXT, bl BLOB, n NUMERIC, dc DECIMAL(10, 2), "
    "bo BOOLEAN, d DATE, dtm DATETIME, js JSON, untyped"
)
ROWS = [
    (
        1,
        1,
        2**63 - 1,
        1e308,
        "é 🙂",
        b"",
        "1.10",
        12.345,
        1,
        "2024-01-01",
        "2024-01-01 10:00:00.123456",
        '{"a": 1}',
        3.5,
    ),
    (2, 2, -(2**63), -0.0, "", b"\x00\xff", "12345678901234567890", 1, 0, "2024-02-30", "yesterday", "[1, 2]", "text"),
    (3, 3, None, None, None, None, None, None, None, None, None, None, None),
]
EXPECTED: dict[int, dict[str, Any]] = {
    1: {"i": 2**63 - 1, "r": 1e308, "tx": "é 🙂", "bl": b"", "n": Decimal("1.1"), "dc": Decimal("12.345"), "bo": True,
        "d": dt.date(2024, 1, 1), "dtm": dt.datetime(2024, 1, 1, 10, 0, 0, 123456), "js": {"a": 1}, "untyped": 3.5},
    2: {"i": -(2**63), "r": 0.0, "tx": "", "bl": b"\x00\xff", "n": Decimal("1.2345678901234567E+19"), "dc": Decimal(1),
        "bo": False, "d": "2024-02-30", "dtm": "yesterday", "js": [1, 2], "untyped": "text"},
}  # fmt: skip


def _handled(url: str) -> dict[int, dict[str, Any]]:
    engine = sa.create_engine(url)
    try:
        config = poller_config(url, table="t", cursor="c", pk=("id",))
        source = SqlSource(config, engine)
        events = page_batch(config, source.fingerprint, source.fetch(None, 1000)).events
        decoded = codec.decode_events([codec.loads(codec.dumps(codec.encode_event(e))) for e in events], "p")
    finally:
        engine.dispose()
    return {e.pk["id"]: dict(e.after or {}) for e in decoded}


def _create(url: str, rows: list[tuple[Any, ...]]) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE IF NOT EXISTS t ({COLUMNS})")
        conn.exec_driver_sql(f"INSERT INTO t VALUES ({', '.join('?' * 13)})", rows)
    engine.dispose()


def test_every_sqlite_value_arrives_as_stored_and_none_stops_the_poller(sqlite_url: str) -> None:
    # Given numbers, text, blobs and dates a SQLite table holds (some no date parser accepts)
    _create(sqlite_url, ROWS)
    # When keyset reads them; Then each arrives as stored, typed by its declared type where it parses
    got = _handled(sqlite_url)
    for key, row in EXPECTED.items():
        for column, want in row.items():
            value = got[key][column]
            assert (type(value), str(value)) == (type(want), str(want)), (key, column, value)
    assert all(v is None for k, v in got[3].items() if k not in ("id", "c"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    numbers=st.lists(
        st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.decimals(places=3, allow_nan=False,
        allow_infinity=False).map(str), min_size=1, max_size=5),
)  # fmt: skip
def test_generated_numbers_in_a_decimal_column_arrive_as_the_number_stored(sqlite_url: str, numbers: list[Any]) -> None:
    # Given numbers stored in a DECIMAL(10, 2) column (SQLite keeps them as INTEGER, REAL or TEXT)
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE IF EXISTS t")
        conn.exec_driver_sql(f"CREATE TABLE t ({COLUMNS})")
        conn.exec_driver_sql("INSERT INTO t (id, c, dc) VALUES (?, ?, ?)", [(i, i, n) for i, n in enumerate(numbers)])
        stored: dict[Any, Any] = dict(conn.exec_driver_sql("SELECT id, dc FROM t").all())
    engine.dispose()
    # When keyset reads them; Then each is the Decimal of the number SQLite holds
    got = _handled(sqlite_url)
    for key, value in stored.items():
        want = Decimal(repr(value)) if isinstance(value, float) else Decimal(value) if isinstance(value, int) else value
        assert str(got[key]["dc"]) == str(want) and type(got[key]["dc"]) is type(want)
