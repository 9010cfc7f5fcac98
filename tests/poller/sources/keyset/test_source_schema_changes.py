"""A keyset source follows ALTER TABLE under a long-lived process (issue 32): one migration kind per
test, every dialect, with the source pinned as the tick pins it.

The first fetch after a migration returns the rows in the table's new shape (no failed tick, no
restart); the fingerprint does not change; a change to the cursor or a key column is a clear
error naming the column and the runbook, on every fetch, never a page.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from poller.ports import SourceRow
from poller.sources.keyset import table_shape
from poller.sources.keyset.source import SqlSource
from poller.sources.outbox import OutboxSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.codec import decode_state
from shared.errors import ConfigError, SchemaChangeError
from shared.models import Position
from tests.poller.outbox_support import Outbox, outbox_poller, read_until
from tests.poller.source_fixtures import create, drain, engine, poller_config
from tests.poller.tick_support import RecordingSink, make_poller
from tests.support.databases import unique_name

__all__ = ["engine"]  # the fixture, re-exported for pytest

pytestmark = pytest.mark.integration

RUNBOOK = "docs/operations.md#schema-changes-migrations"
BIG = 2**40  # needs BIGINT
LONG = "x" * 300  # needs TEXT (longer than VARCHAR(40))


def _table(engine: sa.Engine, rows: int = 5) -> str:
    name = unique_name()
    create(
        engine,
        name,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("c", sa.BigInteger, nullable=False),
        sa.Column("payload", sa.String(40)),
        sa.Column("n", sa.Integer),
        sa.Index(f"ix_{name}", "c", "id"),
        rows=[{"id": i, "c": i, "payload": f"p{i}", "n": i} for i in range(1, rows + 1)],
    )
    return name


def _execute(engine: sa.Engine, *statements: str, **params: Any) -> None:
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(sa.text(statement), params)


def _retype_statements(engine: sa.Engine, t: str) -> list[str]:
    """int -> bigint and varchar -> text, as each database spells it (SQLite: the table rebuild)."""
    dialect = engine.dialect.name
    if dialect == "postgresql":
        return [f"ALTER TABLE {t} ALTER COLUMN n TYPE BIGINT, ALTER COLUMN payload TYPE TEXT"]
    if dialect in ("mysql", "mariadb"):
        return [f"ALTER TABLE {t} MODIFY COLUMN n BIGINT, MODIFY COLUMN payload TEXT"]
    return [  # https://www.sqlite.org/lang_altertable.html#otheralter
        f"CREATE TABLE {t}_new (id INTEGER NOT NULL PRIMARY KEY, c BIGINT NOT NULL, payload TEXT, n BIGINT)",
        f"INSERT INTO {t}_new SELECT id, c, payload, n FROM {t}",
        f"DROP TABLE {t}",
        f"ALTER TABLE {t}_new RENAME TO {t}",
        f"CREATE INDEX ix_{t} ON {t} (c, id)",
    ]


# migration -> (the ALTER, the new row written after it, what the new row and the touched old row carry)
def _migration(engine: sa.Engine, t: str, kind: str) -> tuple[list[str], str, dict[str, Any], dict[str, Any]]:
    new = f"INSERT INTO {t} (id, c, payload, n) VALUES (6, 6, 'p6', 6)"
    if kind == "add_nullable":
        return (
            [f"ALTER TABLE {t} ADD COLUMN extra VARCHAR(20)"],
            f"INSERT INTO {t} (id, c, payload, n, extra) VALUES (6, 6, 'p6', 6, 'e6')",
            {"id": 6, "c": 6, "payload": "p6", "n": 6, "extra": "e6"},
            {"id": 1, "c": 7, "payload": "p1", "n": 1, "extra": None},
        )
    if kind == "add_default":
        return (
            [f"ALTER TABLE {t} ADD COLUMN flag INTEGER NOT NULL DEFAULT 7"],
            new,
            {"id": 6, "c": 6, "payload": "p6", "n": 6, "flag": 7},
            {"id": 1, "c": 7, "payload": "p1", "n": 1, "flag": 7},
        )
    if kind == "rename":
        return (
            [f"ALTER TABLE {t} RENAME COLUMN payload TO note"],
            f"INSERT INTO {t} (id, c, note, n) VALUES (6, 6, 'p6', 6)",
            {"id": 6, "c": 6, "note": "p6", "n": 6},
            {"id": 1, "c": 7, "note": "p1", "n": 1},
        )
    if kind == "retype":
        return (
            _retype_statements(engine, t),
            f"INSERT INTO {t} (id, c, payload, n) VALUES (6, 6, '{LONG}', {BIG})",
            {"id": 6, "c": 6, "payload": LONG, "n": BIG},
            {"id": 1, "c": 7, "payload": "p1", "n": 1},
        )
    assert kind == "drop"
    return (
        [f"ALTER TABLE {t} DROP COLUMN payload"],
        f"INSERT INTO {t} (id, c, n) VALUES (6, 6, 6)",
        {"id": 6, "c": 6, "n": 6},
        {"id": 1, "c": 7, "n": 1},
    )


@contextmanager
def _statements(engine: sa.Engine) -> Iterator[list[str]]:
    """Every statement ``engine`` sends while inside."""
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)


def _fetch(source: SqlSource, after: Position | None) -> list[SourceRow]:
    return list(source.fetch(after, 100).rows)


@pytest.mark.parametrize("kind", ["add_nullable", "add_default", "rename", "retype", "drop"])
def test_the_first_fetch_after_a_migration_carries_the_tables_new_shape(engine: sa.Engine, kind: str) -> None:
    # Given a source that has read the table (its plan made) and stays up, as the resident poller does
    t = _table(engine)
    source = SqlSource(poller_config(str(engine.url), table=t), engine)
    fingerprint = source.fingerprint
    with source.pinned():
        seen = drain(source, limit=2)
        assert [r.values["payload"] for r in seen] == ["p1", "p2", "p3", "p4", "p5"]
        # When the table is migrated, then a new row is written and an old one updated
        alter, insert, new_row, old_row = _migration(engine, t, kind)
        _execute(engine, *alter)
        _execute(engine, insert, f"UPDATE {t} SET c = 7 WHERE id = 1")
        # Then the very next fetch (same process, same tick) carries both in the new shape
        rows = _fetch(source, seen[-1].position)
    assert [dict(r.values) for r in rows] == [new_row, old_row]
    assert {type(v) for r in rows for k, v in r.values.items() if k == "n"} == {int}
    # And the fingerprint, which guards the checkpoint, is the same: no reset needed
    assert source.fingerprint == fingerprint


def test_migrations_in_sequence_keep_every_row_in_its_current_shape(engine: sa.Engine) -> None:
    # Given a running source
    t = _table(engine)
    source = SqlSource(poller_config(str(engine.url), table=t), engine)
    with source.pinned():
        after = drain(source, limit=10)[-1].position
        # When every kind of migration lands in turn, a row written after each
        shapes: list[set[str]] = []
        for step, statements in enumerate(
            (
                [f"ALTER TABLE {t} ADD COLUMN extra VARCHAR(20)"],
                [f"ALTER TABLE {t} ADD COLUMN flag INTEGER NOT NULL DEFAULT 7"],
                [f"ALTER TABLE {t} RENAME COLUMN payload TO note"],
                [f"ALTER TABLE {t} DROP COLUMN extra"],
            )
        ):
            _execute(engine, *statements)
            _execute(engine, f"INSERT INTO {t} (id, c, n) VALUES (:i, :i, :i)", i=100 + step)
            rows = _fetch(source, after)
            # Then each fetch delivers the new row, in the shape of that moment
            assert [r.values["id"] for r in rows] == [100 + step]
            shapes.append(set(rows[0].values))
            after = rows[-1].position
    assert shapes == [
        {"id", "c", "payload", "n", "extra"},
        {"id", "c", "payload", "n", "extra", "flag"},
        {"id", "c", "note", "n", "extra", "flag"},
        {"id", "c", "note", "n", "flag"},
    ]


def test_an_idle_fetch_costs_one_statement_before_and_after_a_migration(engine: sa.Engine) -> None:
    # Given a caught-up source (its first fetch also counted the NULL cursors)
    t = _table(engine)
    source = SqlSource(poller_config(str(engine.url), table=t), engine)
    with source.pinned():
        after = drain(source, limit=10)[-1].position
        # When it fetches while nothing changes, Then each fetch is one SELECT: no catalog check
        with _statements(engine) as idle:
            for _ in range(3):
                assert _fetch(source, after) == []
        assert len(idle) == 3, idle
        # And after a migration the re-planning costs statements once, then idle is one SELECT again
        _execute(engine, f"ALTER TABLE {t} ADD COLUMN extra VARCHAR(20)")
        assert _fetch(source, after) == []
        with _statements(engine) as idle:
            for _ in range(3):
                assert _fetch(source, after) == []
        assert len(idle) == 3, idle


@pytest.mark.parametrize(("column", "role"), [("c", "cursor"), ("id", "pk")])
def test_renaming_the_cursor_or_a_key_column_is_an_error_naming_it_and_the_runbook(
    engine: sa.Engine, column: str, role: str
) -> None:
    # Given a running source
    t = _table(engine)
    source = SqlSource(poller_config(str(engine.url), table=t), engine)
    with source.pinned():
        after = drain(source, limit=10)[-1].position
        # When a migration renames its cursor (or key) column, and a row is written after it
        _execute(engine, f"ALTER TABLE {t} RENAME COLUMN {column} TO {column}_renamed")
        # Then every fetch fails with an error naming the column, its role and the runbook (never a page)
        for _ in range(2):
            with pytest.raises(SchemaChangeError) as caught:
                source.fetch(after, 100)
            message = str(caught.value)
            assert f"{role} column {column!r}" in message and t in message and RUNBOOK in message, message
        # And reverting the migration lets the same source go on by itself
        _execute(engine, f"ALTER TABLE {t} RENAME COLUMN {column}_renamed TO {column}")
        _execute(engine, f"INSERT INTO {t} (id, c, payload, n) VALUES (6, 6, 'p6', 6)")
        assert [r.values["id"] for r in _fetch(source, after)] == [6]
        _execute(engine, f"ALTER TABLE {t} RENAME COLUMN {column} TO {column}_renamed")
    # And a fresh process (a restart, `dbfanout status`) names the setting, the column and the runbook
    with pytest.raises(ConfigError, match=rf"pollers\.orders\.{role}: column {column!r} .*{RUNBOOK}"):
        SqlSource(poller_config(str(engine.url), table=t), engine).fetch(after, 100)


def test_a_cursor_column_whose_kind_changes_is_an_operator_decision(engine: sa.Engine) -> None:
    # Given a running source over an integer cursor
    t = _table(engine)
    source = SqlSource(poller_config(str(engine.url), table=t), engine)
    with source.pinned():
        after = drain(source, limit=10)[-1].position
        # When a migration makes the cursor text (its checkpointed values would compare differently)
        dialect = engine.dialect.name
        if dialect == "postgresql":
            _execute(engine, f"ALTER TABLE {t} ALTER COLUMN c TYPE VARCHAR(20)")
        elif dialect in ("mysql", "mariadb"):
            _execute(engine, f"ALTER TABLE {t} MODIFY COLUMN c VARCHAR(20) NOT NULL")
        else:
            _execute(
                engine,
                f"CREATE TABLE {t}_new (id INTEGER NOT NULL PRIMARY KEY, c VARCHAR(20) NOT NULL, payload TEXT, n INT)",
                f"INSERT INTO {t}_new SELECT id, c, payload, n FROM {t}",
                f"DROP TABLE {t}",
                f"ALTER TABLE {t}_new RENAME TO {t}",
            )
        _execute(engine, f"INSERT INTO {t} (id, c, payload, n) VALUES (6, '6', 'p6', 6)")
        # Then every fetch fails naming the cursor column and the runbook (SQLite: seen in the new row's value)
        for _ in range(2):
            with pytest.raises(SchemaChangeError, match=rf"cursor column 'c'.*{RUNBOOK}"):
                source.fetch(after, 100)


def test_a_key_column_widened_from_int_to_bigint_goes_on(engine: sa.Engine) -> None:
    # Given a running source (the commonest type change of all: the id runs out of int)
    t = _table(engine)
    source = SqlSource(poller_config(str(engine.url), table=t), engine)
    with source.pinned():
        after = drain(source, limit=10)[-1].position
        dialect = engine.dialect.name
        if dialect == "postgresql":
            _execute(engine, f"ALTER TABLE {t} ALTER COLUMN id TYPE BIGINT")
        elif dialect in ("mysql", "mariadb"):
            _execute(engine, f"ALTER TABLE {t} MODIFY COLUMN id BIGINT NOT NULL")
        else:
            pytest.skip("SQLite's INTEGER PRIMARY KEY is 64-bit already")
        _execute(engine, f"INSERT INTO {t} (id, c, payload, n) VALUES ({BIG}, 6, 'p6', 6)")
        # Then the next fetch delivers the row with the wide key
        rows = _fetch(source, after)
    assert [r.position.pk["id"] for r in rows] == [BIG]


def test_query_mode_follows_a_select_star_query_through_add_rename_and_drop(engine: sa.Engine) -> None:
    # Given a query-mode source over SELECT *
    t = _table(engine)
    source = SqlSource(poller_config(str(engine.url), query=f"SELECT * FROM {t}"), engine)
    with source.pinned():
        after = drain(source, limit=10)[-1].position
        # When columns are added, renamed and dropped, a row written after each
        shapes = []
        for step, statement in enumerate(
            (
                f"ALTER TABLE {t} ADD COLUMN extra VARCHAR(20)",
                f"ALTER TABLE {t} RENAME COLUMN payload TO note",
                f"ALTER TABLE {t} DROP COLUMN extra",
            )
        ):
            _execute(engine, statement)
            _execute(engine, f"INSERT INTO {t} (id, c, n) VALUES (:i, :i, :i)", i=100 + step)
            rows = _fetch(source, after)
            shapes.append(set(rows[0].values))
            after = rows[-1].position
    # Then each row comes in the query's shape of the moment
    assert shapes == [{"id", "c", "payload", "n", "extra"}, {"id", "c", "note", "n", "extra"}, {"id", "c", "note", "n"}]


def test_an_outbox_follows_its_own_table_and_names_a_contract_column_a_migration_took(any_db_url: str) -> None:
    # Given an outbox source that has read a change
    box = Outbox(any_db_url)
    try:
        source = OutboxSource(outbox_poller(any_db_url, box.name))
        box.write("order-1", "created", {"total": 1})
        first = read_until(source, None, 1)
        # When the outbox table gains a column and the application's payload gains a key (its own migration)
        with box.engine.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE {box.name} ADD COLUMN tenant VARCHAR(20)")
        box.write("order-1", "updated", {"total": 2, "currency": "EUR"})
        # Then the next change arrives, its after being what the application wrote
        later = read_until(source, first[-1].position, 1)
        assert [dict(r.values) for r in later] == [{"total": 2, "currency": "EUR"}]
        # When a migration renames one of the outbox's own columns
        with box.engine.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE {box.name} RENAME COLUMN payload TO body")
        # Then the next read is a ConfigError naming the column (the checkpoint cannot move)
        with pytest.raises(ConfigError, match=r"lacks column.*payload"):
            source.fetch(later[-1].position, 10)
    finally:
        box.drop()


def test_the_fingerprint_covers_the_configuration_not_the_columns_so_existing_state_blobs_keep_matching() -> None:
    # Given the configurations of a keyset and an outbox poller (no connection is made)
    url = "postgresql+psycopg://app:secret@db.example.com:5432/shop"
    keyset = SqlSource(
        poller_config(url, table="orders", cursor="updated_at", filter="tenant = 1", soft_delete_column="deleted_at")
    )
    outbox = OutboxSource(outbox_poller(url, "app_outbox"))
    # Then their fingerprints are the ones state blobs written by earlier versions hold (a change here
    # would stop every deployed poller with a FingerprintMismatchError after an upgrade)
    assert keyset.fingerprint == "sha256:06c9c58b819c2d66ba9855f5852c0ee44f04f1fde7d90fadbbcad70c87012a2b"
    assert outbox.fingerprint == "sha256:238df02ffb350704d5794535a415a77977eced39282971d23b03f64e1bff0bbd"


def test_a_state_blob_written_before_migrations_is_resumed_by_the_running_and_a_restarted_poller(
    engine: sa.Engine,
) -> None:
    # Given a poller that delivered the table and checkpointed (its state blob written before any migration)
    t = _table(engine)
    poller = dataclasses.replace(make_poller(str(engine.url), t), cursor="c", soft_delete_column=None)
    store, sink = MemoryStateStore("orders"), RecordingSink()
    running = SqlSource(poller, engine)
    run_tick(poller, running, store, sink, owner_id="host-a")
    written_before = store.blob.data
    # When a column is added and a row written, Then the running poller delivers it from that blob
    _execute(engine, f"ALTER TABLE {t} ADD COLUMN extra VARCHAR(20)")
    _execute(engine, f"INSERT INTO {t} (id, c, payload, n, extra) VALUES (6, 6, 'p6', 6, 'e6')")
    run_tick(poller, running, store, sink, owner_id="host-a")
    # When a column is renamed and a row written, Then a restarted poller (a new process) resumes the blob too
    _execute(engine, f"ALTER TABLE {t} RENAME COLUMN payload TO note")
    _execute(engine, f"INSERT INTO {t} (id, c, note, n, extra) VALUES (7, 7, 'p7', 7, 'e7')")
    run_tick(poller, SqlSource(poller, engine), store, sink, owner_id="host-b")
    events = [e for b in sink.accepted for e in b.events]
    assert [(e.pk["id"], sorted(e.after or {})) for e in events[5:]] == [
        (6, ["c", "extra", "id", "n", "payload"]),
        (7, ["c", "extra", "id", "n", "note"]),
    ]
    assert written_before is not None and decode_state(written_before).source_fingerprint == running.fingerprint
    assert [e.pk["id"] for e in events] == [1, 2, 3, 4, 5, 6, 7]


def test_an_idle_tick_runs_one_statement_on_the_source_before_and_after_a_migration(engine: sa.Engine) -> None:
    # Given a caught-up poller ticking as the timer does (its first tick also counted the NULL cursors)
    t = _table(engine)
    poller = dataclasses.replace(make_poller(str(engine.url), t), cursor="c", soft_delete_column=None)
    store, sink, source = MemoryStateStore("orders"), RecordingSink(), SqlSource(poller, engine)
    run_tick(poller, source, store, sink, owner_id="host-a")

    def idle_statements() -> int:
        with _statements(engine) as seen:
            assert run_tick(poller, source, store, sink, owner_id="host-a").stop_reason == "caught_up"
        return len(seen)

    # Then an idle tick sends one statement to the source, before and after a migration (no catalog check)
    before = [idle_statements() for _ in range(3)]
    _execute(engine, f"ALTER TABLE {t} ADD COLUMN extra VARCHAR(20)")
    run_tick(poller, source, store, sink, owner_id="host-a")  # the tick that re-plans
    assert before == [1, 1, 1] and [idle_statements() for _ in range(3)] == [1, 1, 1]


def test_a_filter_naming_a_renamed_column_is_an_error_naming_the_filter_and_the_runbook(engine: sa.Engine) -> None:
    # Given a running source whose filter names a column
    t = _table(engine)
    source = SqlSource(poller_config(str(engine.url), table=t, filter="payload <> 'hidden'"), engine)
    with source.pinned():
        after = drain(source, limit=10)[-1].position
        # When a migration renames that column
        _execute(engine, f"ALTER TABLE {t} RENAME COLUMN payload TO note")
        # Then the fetch, re-planned for the new shape, still fails: the error says the filter may be why
        with pytest.raises(SchemaChangeError, match=rf"the filter may name a column.*{RUNBOOK}"):
            source.fetch(after, 100)


def test_the_runbook_the_errors_name_is_a_heading_of_the_operations_guide() -> None:
    # GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens
    guide = Path(__file__).resolve().parents[4] / "docs" / "operations.md"
    anchors = {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in guide.read_text().splitlines()
        if line.startswith("#")
    }
    path, _, anchor = table_shape.RUNBOOK.partition("#")
    assert path == "docs/operations.md" and anchor in anchors


def test_a_select_star_page_decodes_every_type_as_sqlalchemys_typed_select_does(engine: sa.Engine) -> None:
    # Given a table of many column types (the page selects *, with the reflected types' processors)
    name = unique_name()
    table = create(
        engine,
        name,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("c", sa.BigInteger, nullable=False),
        sa.Column("amount", sa.Numeric(12, 3)),
        sa.Column("ratio", sa.Float),
        sa.Column("flag", sa.Boolean),
        sa.Column("day", sa.Date),
        sa.Column("at", sa.DateTime),
        sa.Column("blob", sa.LargeBinary),
        sa.Column("doc", sa.JSON),
        sa.Column("label", sa.String(30)),
        rows=[
            {
                "id": 1,
                "c": 1,
                "amount": Decimal("12.345"),
                "ratio": 0.5,
                "flag": True,
                "day": dt.date(2026, 1, 2),
                "at": dt.datetime(2026, 1, 2, 3, 4, 5),
                "blob": b"\x00\x01",
                "doc": {"a": [1, 2]},
                "label": "x",
            },
            {
                "id": 2,
                "c": 2,
                "amount": None,
                "ratio": None,
                "flag": False,
                "day": None,
                "at": None,
                "blob": None,
                "doc": None,
                "label": None,
            },
        ],
    )
    # When the source reads it, Then each value is the one a typed SELECT of the reflected table gives
    reflected = sa.Table(name, sa.MetaData(), autoload_with=engine)
    with engine.connect() as conn:
        typed = [dict(r) for r in conn.execute(sa.select(reflected).order_by(reflected.c.id)).mappings()]
    rows = drain(SqlSource(poller_config(str(engine.url), table=name), engine), limit=10)
    assert [dict(r.values) for r in rows] == typed
    assert typed[0]["amount"] == Decimal("12.345") and table is not None
