"""Every PostgreSQL type arrives exactly, and the same, through keyset and pg_logical (issue 42).

One table with a column of every built-in type family (and an enum, a domain, arrays, ranges),
rows written then updated; each source kind's events go through the envelope (encode, JSON,
decode) as a handler gets them, and are compared value by value with what psycopg reads
(docs/types.md) and with each other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa

from poller.sources.keyset.source import SqlSource
from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.memory import MemoryStateStore
from poller.tick.events import page_batch
from shared import codec
from shared.codec.ranges import is_range
from shared.models import RowChange
from tests.poller.pg_logical_support import LogicalTable, events_of, logical_table
from tests.poller.source_fixtures import poller_config as keyset_config
from tests.poller.tick_support import RecordingSink, drain

pytestmark = pytest.mark.integration

# column -> (type, first row's literal, second row's literal); the third row is all NULL
COLUMNS: dict[str, tuple[str, str, str]] = {
    "i2": ("smallint", "-32768", "32767"),
    "i8": ("bigint", "-9223372036854775808", "9223372036854775807"),
    "num": ("numeric", "123456789012345678901234567890.123456789012345678901234567890", "'NaN'"),
    "nump": ("numeric(30, 20)", "-1.1", "0"),
    "r4": ("real", "'NaN'", "'3.4e38'"),
    "f8": ("double precision", "1.2345678901234567e-7", "'-Infinity'"),
    "f8b": ("double precision", "1e308", "'Infinity'"),
    "money": ("money", "12.34", "-0.01"),
    "bool": ("boolean", "true", "false"),
    "txt": ("text", "'é 🙂'", "''"),
    "ch": ("char(3)", "'a'", "'abc'"),
    "by": ("bytea", "'\\x00ff'", "''"),
    "u": ("uuid", "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "'00000000-0000-0000-0000-000000000000'"),
    "d": ("date", "'0001-01-01'", "'9999-12-31'"),
    "t": ("time", "'23:59:59.999999'", "'00:00'"),
    "tt": ("timetz", "'12:00:00+05:30'", "'00:00:00.000001-08'"),
    "ts": ("timestamp(6)", "'2024-02-29 12:34:56.123456'", "'0001-01-01 00:00'"),
    "tz": ("timestamptz", "'2024-06-01 00:00:00.000001+02'", "'1970-01-01 00:00+00'"),
    "iv": ("interval", "'3 days 04:05:06.789'", "'-00:00:00.000001'"),
    "js": ("json", "'{\"a\": [1, 2.5]}'", "'[]'"),
    "jb": ("jsonb", '\'{"b": {"c": null}, "n": 12345678901234567890}\'', "'\"s\"'"),
    "x": ("xml", "'<a>1</a>'", "''"),
    "tsv": ("tsvector", "'a fat cat'", "''"),
    "inet": ("inet", "'192.168.0.1/24'", "'::1'"),
    "inet2": ("inet", "'10.0.0.1'", "'2001:db8::1/64'"),
    "cidr": ("cidr", "'10.0.0.0/8'", "'2001:db8::/32'"),
    "mac": ("macaddr", "'08:00:2b:01:02:03'", "'ff:ff:ff:ff:ff:ff'"),
    "b": ("bit(8)", "B'10100101'", "B'00000000'"),
    "vb": ("varbit", "B'101'", "B''"),
    "pt": ("point", "'(1.5,2)'", "'(0,0)'"),
    "box": ("box", "'(1,1),(0,0)'", "'(2,2),(1,1)'"),
    "circ": ("circle", "'<(0,0),1>'", "'<(1,1),0.5>'"),
    "poly": ("polygon", "'((0,0),(1,1),(1,0))'", "'((0,0))'"),
    "i4r": ("int4range", "'[1,5)'", "'(,)'"),
    "i8r": ("int8range", "'[1,9223372036854775806]'", "'empty'"),
    "nr": ("numrange", "'(,2.50]'", "'empty'"),
    "tsr": ("tstzrange", "'[2024-01-01 00:00+00,2024-02-01 00:00+00)'", "'(,1970-01-01 00:00+00]'"),
    "dr": ("daterange", "'[2024-01-01,2024-02-01)'", "'empty'"),
    "ia": ("integer[]", "'{1,NULL,3}'", "'{}'"),
    "ta": ("text[]", "'{\"a,b\",c}'", "'{{x,y},{z,w}}'"),
    "na": ("numeric[]", "'{1.10,NaN}'", "'{}'"),
    "da": ("date[]", "'{2024-01-01,NULL}'", "'{}'"),
    "em": ("{enum}", "'b'", "'a'"),
    "dom": ("{domain}", "42", "-1"),
    "doma": ("{domain}[]", "'{1,2}'", "'{}'"),
    "pl": ("pg_lsn", "'16/B374D848'", "'0/0'"),
    "o": ("oid", "12345", "0"),
}


@pytest.fixture
def table(pg_logical_url: str) -> Iterator[LogicalTable]:
    with logical_table(pg_logical_url, slot=False) as made:
        enum, domain = f"{made.name}_e", f"{made.name}_d"
        with made.engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TYPE {enum} AS ENUM ('a', 'b')"))
            conn.execute(sa.text(f"CREATE DOMAIN {domain} AS integer CHECK (VALUE > -10)"))
            columns = ", ".join(f"{n} {t.format(enum=enum, domain=domain)}" for n, (t, _, _) in COLUMNS.items())
            conn.execute(sa.text(f"DROP TABLE {made.name}"))
            conn.execute(sa.text(f"CREATE TABLE {made.name} (id integer PRIMARY KEY, c bigint NOT NULL, {columns})"))
            conn.execute(sa.text(f"ALTER TABLE {made.name} REPLICA IDENTITY FULL"))
        made.create_slot()
        try:
            yield made
        finally:
            with made.engine.begin() as conn:
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {made.name}"))
                conn.execute(sa.text(f"DROP DOMAIN IF EXISTS {domain}"))
                conn.execute(sa.text(f"DROP TYPE IF EXISTS {enum}"))


def _write(table: LogicalTable) -> None:
    """Insert three rows (the third all NULL), then update each to the next one's values."""
    rows = [[first for _, first, _ in COLUMNS.values()], [second for _, _, second in COLUMNS.values()]]
    rows.append(["NULL"] * len(COLUMNS))
    names = ", ".join(COLUMNS)
    with table.engine.begin() as conn:
        for i, literals in enumerate(rows, 1):
            conn.execute(sa.text(f"INSERT INTO {table.name} (id, c, {names}) VALUES ({i}, {i}, {', '.join(literals)})"))
    with table.engine.begin() as conn:
        for i, literals in enumerate(rows[1:] + rows[:1], 1):
            sets = ", ".join(f"{n} = {v}" for n, v in zip(COLUMNS, literals, strict=True))
            conn.execute(sa.text(f"UPDATE {table.name} SET c = {10 + i}, {sets} WHERE id = {i}"))


def _handled(events: list[RowChange]) -> list[RowChange]:
    """The events as a handler gets them: through the envelope's JSON."""
    return list(codec.decode_events([codec.loads(codec.dumps(codec.encode_event(e))) for e in events], "p"))


def _keyset(table: LogicalTable) -> dict[int, dict[str, Any]]:
    config = keyset_config(table.url, table=table.name, cursor="c", pk=("id",))
    source = SqlSource(config, table.engine)
    events = _handled(list(page_batch(config, source.fingerprint, source.fetch(None, 100)).events))
    return {e.pk["id"]: dict(e.after or {}) for e in events}


def _driver(table: LogicalTable) -> dict[int, dict[str, Any]]:
    """What psycopg reads, an array of a domain (its text: psycopg does not know its type) as an
    array of the base type (docs/types.md)."""
    with table.engine.connect() as conn:
        rows = [dict(row) for row in conn.exec_driver_sql(f"SELECT * FROM {table.name}").mappings()]
    for row in rows:
        if isinstance(row["doma"], str):
            row["doma"] = [int(v) for v in row["doma"].strip("{}").split(",") if v]
    return {row["id"]: row for row in rows}


def _comparable(value: Any) -> Any:
    """A value in a form equal across psycopg's and the handler's types (a Range is either)."""
    if is_range(value):
        return ("range",) if value.isempty else ("range", value.lower, value.upper, value.lower_inc, value.upper_inc)
    if isinstance(value, float) and math.isnan(value):
        return ("nan",)
    if isinstance(value, Decimal):
        return ("decimal", str(value))
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    return (type(value).__name__, value)


def _agree(expected: dict[int, dict[str, Any]], got: dict[int, dict[str, Any]]) -> None:
    diff = [
        f"id {key} {column}: expected {want!r}, got {got[key].get(column)!r}"
        for key, row in expected.items()
        for column, want in row.items()
        if _comparable(want) != _comparable(got[key].get(column))
    ]
    if diff:
        pytest.fail("\n".join(diff), pytrace=False)


def test_every_postgres_type_arrives_as_psycopg_reads_it_through_keyset_and_pg_logical(table: LogicalTable) -> None:
    # Given a pg_logical slot, and a table with a column of every type
    # When rows are inserted, then updated
    _write(table)
    # Then keyset delivers each value as psycopg reads it, of the same type
    driver = _driver(table)
    _agree(driver, _keyset(table))
    # And pg_logical delivers the same, in the after image of each update and the before image
    store, sink = MemoryStateStore("p"), RecordingSink()
    drain(table.config, PgLogicalSource(table.config), store, sink)
    events = _handled(events_of(sink.accepted))
    updates = [e for e in events if e.change == "update"]
    assert len(updates) == 3
    _agree(driver, {e.pk["id"]: dict(e.after or {}) for e in updates})
    inserted = {e.pk["id"]: dict(e.after or {}) for e in events if e.change == "insert"}
    _agree(inserted, {e.pk["id"]: dict(e.before or {}) for e in updates})


def test_a_value_psycopg_cannot_load_arrives_as_its_text_and_never_stops_a_poller(table: LogicalTable) -> None:
    # Given timestamps and a date psycopg refuses to load (DataError: after year 10K, BC)
    table.sql(
        "INSERT INTO {t} (id, c, ts, tz, d) VALUES (1, 1, 'infinity', '-infinity', '0044-03-15 BC')",
        "INSERT INTO {t} (id, c, i8) VALUES (2, 2, 7)",
    )
    # When keyset reads them (through dbfanout's engine for the URL); Then they arrive as their text
    config = keyset_config(table.url, table=table.name, cursor="c", pk=("id",))
    source = SqlSource(config)
    page = _handled(list(page_batch(config, source.fingerprint, source.fetch(None, 100)).events))
    assert [(e.after or {}).get("ts") for e in page] == ["infinity", None]
    assert ((page[0].after or {})["tz"], (page[0].after or {})["d"]) == ("-infinity", "0044-03-15 BC")
    # And when pg_logical reads them
    store, sink = MemoryStateStore("p"), RecordingSink()
    drain(table.config, PgLogicalSource(table.config), store, sink)
    # Then they arrive as the database's text, and the rows after them arrive too
    events = _handled(events_of(sink.accepted))
    assert [e.pk["id"] for e in events] == [1, 2]
    after = events[0].after or {}
    assert (after["ts"], after["tz"], after["d"]) == ("infinity", "-infinity", "0044-03-15 BC")
    assert (events[1].after or {})["i8"] == 7


def test_a_snapshot_chunk_delivers_every_postgres_type_as_the_stream_does(table: LogicalTable) -> None:
    # Given rows of every type that exist before the poller's first tick (snapshot = "initial")
    _write(table)
    config = dataclasses.replace(table.config, snapshot="initial", snapshot_chunk_size=2)
    # When the snapshot reads them in chunks
    store, sink = MemoryStateStore("p"), RecordingSink()
    drain(config, PgLogicalSource(config), store, sink)
    reads = [e for e in _handled(events_of(sink.accepted)) if e.change == "read"]
    # Then each value arrives as keyset and the stream give it (docs/types.md)
    assert len(reads) == 3
    _agree(_driver(table), {e.pk["id"]: dict(e.after or {}) for e in reads})
