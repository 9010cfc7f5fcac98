"""Generated values of each type (hypothesis), through every source kind of their database (issue 42).

Each example writes a few rows of generated values to one table per database; the rows are read
by psycopg/pymysql, by keyset and by the log source (pg_logical, mysql_binlog), and what a
handler gets from each (through the envelope's JSON) must equal the driver's read, value by
value (docs/types.md's forms). Examples are few (``max_examples=25``): each is a round trip.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import json
import math
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poller.sources.keyset.source import SqlSource
from poller.sources.mysql_binlog.source import MysqlBinlogSource
from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.memory import MemoryStateStore
from poller.tick.events import page_batch
from shared import codec
from shared.codec.ranges import is_range
from shared.models import RowChange
from tests.poller.mysql_binlog_support import poller_config as binlog_config
from tests.poller.pg_logical_support import LogicalTable, events_of, logical_table
from tests.poller.source_fixtures import poller_config as keyset_config
from tests.poller.tick_support import RecordingSink, drain
from tests.support.databases import unique_name

pytestmark = pytest.mark.integration

_IDS = itertools.count(1)
_TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=20)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=6,
)


@dataclasses.dataclass
class Reader:
    """A table, and each way of reading it (the log source keeps its store and sink across examples)."""

    name: str
    engine: sa.Engine
    keyset: SqlSource
    log: Any
    log_config: Any
    store: MemoryStateStore = dataclasses.field(default_factory=lambda: MemoryStateStore("p"))
    sink: RecordingSink = dataclasses.field(default_factory=RecordingSink)

    def rows(self, ids: list[int]) -> dict[str, dict[int, dict[str, Any]]]:
        """Each reader's rows of ``ids``: the driver's, keyset's, the log's (the latest image)."""
        with self.engine.connect() as conn:
            found = conn.exec_driver_sql(f"SELECT * FROM {self.name} WHERE id IN ({', '.join(map(str, ids))})")
            driver = {r["id"]: dict(r) for r in found.mappings()}
        page = self.keyset.fetch(None, 10_000)
        events = _handled(list(page_batch(self.keyset._config, self.keyset.fingerprint, page).events))
        keyset = {e.pk["id"]: dict(e.after or {}) for e in events if e.pk["id"] in ids}
        drain(self.log_config, self.log, self.store, self.sink)
        logged = {e.pk["id"]: dict(e.after or {}) for e in _handled(events_of(self.sink.accepted)) if e.pk["id"] in ids}
        return {"driver": driver, "keyset": keyset, "log": logged}


def _handled(events: list[RowChange]) -> list[RowChange]:
    return list(codec.decode_events([codec.loads(codec.dumps(codec.encode_event(e))) for e in events], "p"))


def _comparable(value: Any) -> Any:
    if is_range(value):
        return ("range",) if value.isempty else ("range", value.lower, value.upper, value.lower_inc, value.upper_inc)
    if isinstance(value, float) and math.isnan(value):
        return ("nan",)
    if isinstance(value, Decimal):
        return ("decimal", str(value))
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    return (type(value).__name__, value)


def _check(reader: Reader, rows: list[dict[str, Any]], insert: str) -> None:
    ids = [next(_IDS) for _ in rows]
    with reader.engine.begin() as conn:
        conn.execute(
            sa.text(insert.format(t=reader.name)), [{**row, "id": i, "c": i} for row, i in zip(rows, ids, strict=True)]
        )
    got = reader.rows(ids)
    driver = got["driver"]
    for kind in ("keyset", "log"):
        diff = [
            f"{kind} id {key} {column}: driver {want!r}, got {got[kind][key].get(column)!r}"
            for key, row in driver.items()
            for column, want in row.items()
            if _comparable(want) != _comparable(got[kind][key].get(column))
        ]
        assert not diff, "\n".join(diff)


# ------------------------------------------------------------------------------------ PostgreSQL

PG_ROW = st.fixed_dictionaries(
    {
        "i8": st.integers(-(2**63), 2**63 - 1),
        "num": st.decimals(min_value=-(10**20), max_value=10**20, places=6) | st.just(Decimal("NaN")),
        "f8": st.floats(),
        "txt": _TEXT,
        "by": st.binary(max_size=16),
        "tz": st.datetimes(dt.datetime(1, 1, 2), dt.datetime(9999, 12, 30), timezones=st.just(dt.UTC)),
        "d": st.dates(),
        "iv": st.timedeltas(dt.timedelta(days=-(10**6)), dt.timedelta(days=10**6)),
        "lo": st.integers(-(2**31), 2**31 - 2),
        "inet": st.ip_addresses().map(str),
        "ia": st.lists(st.integers(-(2**31), 2**31 - 1) | st.none(), max_size=4),
        "jb": _JSON.map(json.dumps),
    }
)
PG_COLUMNS = (
    "id integer PRIMARY KEY, c bigint NOT NULL, i8 bigint, num numeric, f8 double precision, txt text, by bytea, "
    "tz timestamptz, d date, iv interval, r int4range, inet inet, ia integer[], jb jsonb"
)
PG_INSERT = (
    "INSERT INTO {t} (id, c, i8, num, f8, txt, by, tz, d, iv, r, inet, ia, jb) VALUES (:id, :c, :i8, :num, :f8, "
    ":txt, :by, :tz, :d, :iv, int4range(:lo, :lo + 1), CAST(:inet AS inet), :ia, CAST(:jb AS jsonb))"
)


@pytest.fixture(scope="module")
def pg_reader(pg_logical_url: str) -> Iterator[Reader]:
    with logical_table(pg_logical_url, slot=False) as table:
        _recreate(table)
        config = keyset_config(table.url, table=table.name, cursor="c", pk=("id",))
        yield Reader(table.name, table.engine, SqlSource(config, table.engine), PgLogicalSource(table.config),
                     table.config)  # fmt: skip


def _recreate(table: LogicalTable) -> None:
    with table.engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE {table.name}"))
        conn.execute(sa.text(f"CREATE TABLE {table.name} ({PG_COLUMNS})"))
    table.create_slot()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(PG_ROW, min_size=1, max_size=4))
def test_generated_postgres_values_arrive_as_psycopg_reads_them_through_keyset_and_pg_logical(
    pg_reader: Reader, rows: list[dict[str, Any]]
) -> None:
    _check(pg_reader, rows, PG_INSERT)


# ------------------------------------------------------------------------------------ MariaDB

MY_ROW = st.fixed_dictionaries(
    {
        "bi": st.integers(-(2**63), 2**63 - 1),
        "bu": st.integers(0, 2**64 - 1),
        "dc": st.decimals(min_value=-(10**19), max_value=10**19, places=10),
        "dbl": st.floats(allow_nan=False, allow_infinity=False),
        "vc": _TEXT,
        "vb": st.binary(max_size=16),
        "dt6": st.datetimes(dt.datetime(1000, 1, 1), dt.datetime(9999, 12, 31)),
        "tm": st.timedeltas(-dt.timedelta(hours=838, minutes=59, seconds=59), dt.timedelta(hours=838, minutes=59)),
        "d": st.dates(dt.date(1000, 1, 1)),
        "b": st.integers(0, 2**16 - 1),
        "st": st.sets(st.sampled_from("xyz")).map(lambda s: ",".join(sorted(s))),
    }
)
MY_COLUMNS = (
    "id INT PRIMARY KEY, c BIGINT NOT NULL, bi BIGINT, bu BIGINT UNSIGNED, dc DECIMAL(30, 10), dbl DOUBLE, "
    "vc VARCHAR(40), vb VARBINARY(16), dt6 DATETIME(6), tm TIME(6), d DATE, b BIT(16), st SET('x', 'y', 'z')"
)
MY_INSERT = (
    "INSERT INTO {t} (id, c, bi, bu, dc, dbl, vc, vb, dt6, tm, d, b, st) "
    "VALUES (:id, :c, :bi, :bu, :dc, :dbl, :vc, :vb, :dt6, :tm, :d, :b, :st)"
)


@pytest.fixture(scope="module")
def mysql_reader(mysql_binlog_url: str) -> Iterator[Reader]:
    name = unique_name("tg")
    engine = sa.create_engine(mysql_binlog_url, connect_args={"init_command": "SET time_zone = '+00:00'"})
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {name} ({MY_COLUMNS}) DEFAULT CHARSET = utf8mb4"))
    database = sa.make_url(mysql_binlog_url).database or "test"
    config = dataclasses.replace(binlog_config(mysql_binlog_url, [f"{database}.{name}"]), batch_size=200)
    keyset = SqlSource(keyset_config(mysql_binlog_url, table=name, cursor="c", pk=("id",)), engine)
    try:
        reader = Reader(name, engine, keyset, MysqlBinlogSource(config), config)
        drain(config, reader.log, reader.store, reader.sink)  # the binlog is read from here on
        yield reader
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
        engine.dispose()


def _mysql_driver_forms(rows: dict[int, dict[str, Any]]) -> None:
    """pymysql's BIT bytes and SET text in docs/types.md's forms."""
    for row in rows.values():
        if row["b"] is not None:
            row["b"] = format(int.from_bytes(row["b"], "big"), "016b")
        if row["st"] is not None:
            row["st"] = set(filter(None, row["st"].split(",")))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(MY_ROW, min_size=1, max_size=4))
def test_generated_mysql_values_arrive_as_pymysql_reads_them_through_keyset_and_the_binlog(
    mysql_reader: Reader, rows: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    original = Reader.rows

    def rows_in_documented_forms(self: Reader, ids: list[int]) -> dict[str, dict[int, dict[str, Any]]]:
        got = original(self, ids)
        _mysql_driver_forms(got["driver"])
        return got

    with monkeypatch.context() as patch:
        patch.setattr(Reader, "rows", rows_in_documented_forms)
        _check(mysql_reader, rows, MY_INSERT)
