"""Every MariaDB/MySQL type arrives exactly, and the same, through keyset and the binlog (issue 42).

One table with a column of every type, rows written then updated; each source kind's events go
through the envelope (encode, JSON, decode) as a handler gets them, and are compared value by
value with what the driver reads (mapped by docs/types.md) and with each other.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa

from poller.snapshot.mysql import mysql_signal_sql
from poller.sources.keyset.source import SqlSource
from poller.sources.mysql_binlog.source import MysqlBinlogSource
from poller.state.memory import MemoryStateStore
from poller.tick.events import page_batch
from shared import codec
from shared.models import Position, RowChange
from tests.poller.mysql_binlog_support import events_of
from tests.poller.mysql_binlog_support import poller_config as binlog_config
from tests.poller.source_fixtures import poller_config as keyset_config
from tests.poller.tick_support import RecordingSink, drain
from tests.support.databases import unique_name

pytestmark = pytest.mark.integration

COLUMNS = """
    id INT PRIMARY KEY, c BIGINT NOT NULL,
    ti TINYINT, tu TINYINT UNSIGNED, si SMALLINT, mi MEDIUMINT UNSIGNED, bi BIGINT, bu BIGINT UNSIGNED,
    zf INT(6) ZEROFILL, dc DECIMAL(65, 30), dbl DOUBLE, flt FLOAT, b8 BIT(8), b5 BIT(5), b64 BIT(64),
    tm TIME, tm2 TIME(2), tm6 TIME(6), d DATE, dtm DATETIME, dtm6 DATETIME(6), ts TIMESTAMP(6) NULL, yr YEAR,
    ch CHAR(3), vc VARCHAR(20), tx TEXT, bl BLOB, vb VARBINARY(8), en ENUM('a', 'b'), st SET('x', 'y', 'z'),
    js JSON, geo GEOMETRY
"""
POINT = bytes(4) + bytes.fromhex("0101000000") + struct.pack("<dd", 1.0, 2.0)  # SRID 0, then WKB
ROWS: list[dict[str, Any]] = [
    {  # the values issue 42 saw arrive wrong, and each type's extremes
        "id": 1,
        "ti": -128,
        "tu": 255,
        "si": -32768,
        "mi": 16777215,
        "bi": -(2**63),
        "bu": 2**64 - 1,
        "zf": 42,
        "dc": Decimal("-12345678901234567890123456789012345.123456789012345678901234567890"),
        "dbl": 1.2345678901234567e-7,
        "flt": 0.1,
        "b8": b"\xa5",
        "b5": b"\x05",
        "b64": b"\xff" * 8,
        "tm": "-838:59:59",
        "tm6": "-00:00:01.000001",
        "d": "0000-00-00",
        "dtm": "0000-00-00 00:00:00",
        "dtm6": "9999-12-31 23:59:59.999999",
        "ts": "2038-01-19 03:14:07.999999",
        "yr": 2155,
        "ch": "é",
        "vc": "emoji 🙂",
        "tx": "",
        "bl": b"",
        "vb": b"\x00\x01",
        "en": "b",
        "st": "x,z",
        "js": '{"a": [1, 2.5, null]}',
        "geo": POINT,
    },
    {
        "id": 2,
        "ti": 0,
        "tu": 0,
        "si": 0,
        "mi": 0,
        "bi": 2**63 - 1,
        "bu": 0,
        "zf": 0,
        "dc": Decimal("0"),
        "dbl": 1e308,
        "flt": -1.23457,
        "b8": b"\x00",
        "b5": b"\x1f",
        "b64": b"\x00" * 8,
        "tm": "838:59:59",
        "tm2": "-12:00:00.01",
        "tm6": "-00:00:00.5",
        "d": "1000-01-01",
        "dtm": "1000-01-01 00:00:00",
        "dtm6": "2024-02-29 12:00:00.000001",
        "ts": "1970-01-01 00:00:01",
        "yr": 1901,
        "ch": "",
        "vc": "",
        "tx": "x" * 300,
        "bl": bytes(range(256)),
        "vb": b"",
        "en": "a",
        "st": "",
        "js": "[]",
        "geo": bytes(4) + bytes.fromhex("0101000000") + struct.pack("<dd", -0.5, 1e300),
    },
]
NAMES = ["id", "c", *(n for n in ROWS[0] if n != "id")]
ROWS.append({"id": 3, **{n: None for n in NAMES if n not in ("id", "c")}})
ROWS.append({**ROWS[-1], "id": 4, "tm6": "-838:59:58.999999", "tm2": "00:00:00.99", "dtm6": "0000-00-00 00:00:00"})


@pytest.fixture
def table(mysql_binlog_url: str) -> Iterator[tuple[str, sa.Engine]]:
    name = unique_name("ty")
    # Zero dates are what old schemas hold: the session allows them (the server's default refuses)
    engine = sa.create_engine(
        mysql_binlog_url, connect_args={"init_command": "SET sql_mode = '', time_zone = '+00:00'"}
    )
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {name} ({COLUMNS}) DEFAULT CHARSET = utf8mb4"))
    try:
        yield name, engine
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
        engine.dispose()


def _write(engine: sa.Engine, name: str) -> None:
    """Insert every row, then update each one (its values rotated), so both images are read."""
    cols = ", ".join(NAMES)
    with engine.begin() as conn:
        for row in ROWS:
            conn.execute(sa.text(f"INSERT INTO {name} ({cols}) VALUES ({', '.join(':' + n for n in NAMES)})"),
                         {**row, "c": row["id"]})  # fmt: skip
    with engine.begin() as conn:
        for row, other in zip(ROWS, ROWS[1:] + ROWS[:1], strict=True):
            sets = ", ".join(f"{n} = :{n}" for n in NAMES if n != "id")
            conn.execute(sa.text(f"UPDATE {name} SET {sets} WHERE id = :id"),
                         {**other, "id": row["id"], "c": 10 + row["id"]})  # fmt: skip


def _handled(events: list[RowChange]) -> list[RowChange]:
    """The events as a handler gets them: through the envelope's JSON."""
    return list(codec.decode_events([codec.loads(codec.dumps(codec.encode_event(e))) for e in events], "p"))


def _keyset(url: str, name: str) -> dict[int, dict[str, Any]]:
    config = keyset_config(url, table=name, cursor="c", pk=("id",))
    engine = sa.create_engine(url, connect_args={"init_command": "SET time_zone = '+00:00'"})
    try:
        source = SqlSource(config, engine)
        page = source.fetch(None, 100)
        events = _handled(list(page_batch(config, source.fingerprint, page).events))
    finally:
        engine.dispose()
    return {e.pk["id"]: dict(e.after or {}) for e in events}


def _binlog(url: str, name: str, start: Position, source: MysqlBinlogSource) -> list[RowChange]:
    events: list[RowChange] = []
    after = start
    with source.pinned():
        while len(page := source.fetch(after, 100)):
            events.extend(page_batch(source._config, source.fingerprint, page).events)
            after = page.end or after
    return _handled(events)


def _driver(engine: sa.Engine, name: str) -> dict[int, dict[str, Any]]:
    """What the driver (pymysql) reads, mapped as docs/types.md says each type arrives."""
    bit_widths = {"b8": 8, "b5": 5, "b64": 64}
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(f"SELECT * FROM {name}").mappings().all()
    out = {}
    for row in rows:
        values = dict(row)
        for column, width in bit_widths.items():
            if values[column] is not None:
                values[column] = format(int.from_bytes(values[column], "big"), f"0{width}b")
        if values["st"] is not None:
            values["st"] = set(filter(None, values["st"].split(",")))
        out[row["id"]] = values
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, Decimal) and isinstance(b, Decimal):
        return str(a) == str(b)
    return type(a) is type(b) and a == b


def _differences(expected: dict[int, dict[str, Any]], got: dict[int, dict[str, Any]]) -> str:
    """One line per value that differs (empty: none)."""
    return "\n".join(
        f"id {key} {column}: expected {want!r}, got {got[key].get(column)!r}"
        for key, row in expected.items()
        for column, want in row.items()
        if not _same(want, got[key].get(column))
    )


def _agree(expected: dict[int, dict[str, Any]], got: dict[int, dict[str, Any]]) -> None:
    if diff := _differences(expected, got):
        pytest.fail(diff, pytrace=False)


def test_every_mysql_type_arrives_as_the_driver_reads_it_through_keyset_and_the_binlog(
    table: tuple[str, sa.Engine], mysql_binlog_url: str
) -> None:
    name, engine = table
    database = sa.make_url(mysql_binlog_url).database or "test"
    # Given a binlog poller that has taken its starting point, and a table of every type
    config = dataclasses.replace(binlog_config(mysql_binlog_url, [f"{database}.{name}"]), batch_size=100)
    binlog_source = MysqlBinlogSource(config)
    start = binlog_source.fetch(None, 10).advance
    assert start is not None
    # When rows of every type are inserted, then updated
    _write(engine, name)
    # Then keyset delivers each value as the driver reads it (docs/types.md's forms)
    driver = _driver(engine, name)
    _agree(driver, _keyset(mysql_binlog_url, name))
    # And the binlog delivers the same values, of the same types, in both images of each update
    events = _binlog(mysql_binlog_url, name, start, binlog_source)
    updates = [e for e in events if e.change == "update"]
    assert len(updates) == len(ROWS)
    final = {e.pk["id"]: dict(e.after or {}) for e in updates}
    _agree(driver, final)
    inserted = {e.pk["id"]: dict(e.after or {}) for e in events if e.change == "insert"}
    before = {e.pk["id"]: dict(e.before or {}) for e in updates}
    _agree(inserted, before)
    first = {row["id"]: {**row, "c": row["id"]} for row in ROWS}
    assert set(inserted) == set(first)


def test_a_snapshot_chunk_delivers_every_mysql_type_as_the_stream_does(
    table: tuple[str, sa.Engine], mysql_binlog_url: str
) -> None:
    name, engine = table
    database = sa.make_url(mysql_binlog_url).database or "test"
    # Given rows of every type that exist before the poller's first tick (snapshot = "initial")
    _write(engine, name)
    config = dataclasses.replace(
        binlog_config(mysql_binlog_url, [f"{database}.{name}"]),
        snapshot="initial",
        snapshot_chunk_size=2,
        signal_table=f"{database}.{name}_sig",
    )
    with engine.begin() as conn:
        for statement in mysql_signal_sql(config):
            conn.execute(sa.text(statement))
    # When the snapshot reads them in chunks
    store, sink = MemoryStateStore("p"), RecordingSink()
    try:
        drain(config, MysqlBinlogSource(config), store, sink)
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}_sig"))
    reads = [e for e in _handled(events_of(sink.accepted)) if e.change == "read"]
    # Then each value arrives as keyset and the binlog give it (docs/types.md)
    assert len(reads) == len(ROWS)
    _agree(_driver(engine, name), {e.pk["id"]: dict(e.after or {}) for e in reads})
