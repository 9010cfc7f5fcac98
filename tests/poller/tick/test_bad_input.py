"""The bad-input catalogue: each bad input is a clear typed error and leaves the checkpoint untouched."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa

from poller.sources.keyset.source import SqlSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.codec import decode_state
from shared.config import PollerConfig
from shared.errors import (
    ConfigError,
    CursorError,
    DbFanoutError,
    FetchError,
    FingerprintMismatchError,
    StateFormatError,
    StateUnavailableError,
)
from tests.poller.tick_support import RecordingSink, SourceTable, drain, make_poller


@pytest.fixture
def established(tmp_path: Path) -> tuple[SourceTable, PollerConfig, MemoryStateStore, bytes]:
    """A poller that has committed a checkpoint; returns the state blob's bytes at that point."""
    table = SourceTable(f"sqlite:///{tmp_path / 'src.db'}")
    table.upsert(range(5))
    poller = make_poller(str(table.engine.url))
    store = MemoryStateStore("orders")
    drain(poller, SqlSource(poller), store, RecordingSink())
    table.upsert(range(5, 8))  # pending work the failing tick must not skip
    raw = store.raw()
    assert raw is not None
    return table, poller, store, raw


def _fails(
    poller: PollerConfig, source: SqlSource, store: MemoryStateStore, before: bytes, error: type[DbFanoutError]
) -> DbFanoutError:
    sink = RecordingSink()
    with pytest.raises(error) as info:
        run_tick(poller, source, store, sink, owner_id="a")
    snap = store.load()
    assert snap is not None
    assert snap.doc.checkpoint == decode_state(before).checkpoint  # unchanged
    assert sink.accepted == []  # nothing was handed on
    assert str(info.value)  # a message, with its hint
    return info.value


def test_database_down_is_a_retryable_fetch_error(established) -> None:
    _, poller, store, before = established
    down = sa.create_engine("postgresql+psycopg://postgres@127.0.0.1:1/test", connect_args={"connect_timeout": 2})
    error = _fails(poller, SqlSource(poller, engine=down), store, before, FetchError)
    assert error.retryable


def test_a_renamed_cursor_column_names_the_missing_column(established) -> None:
    table, poller, store, before = established
    with table.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE orders RENAME COLUMN version TO ver2")
    error = _fails(poller, SqlSource(poller), store, before, ConfigError)
    assert "version" in str(error)


def test_a_missing_table_is_a_config_error(established) -> None:
    table, poller, store, before = established
    with table.engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE orders")
    _fails(poller, SqlSource(poller), store, before, ConfigError)


def test_null_cursor_with_the_fail_policy_stops_with_a_cursor_error(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'n.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, version BIGINT, v TEXT, deleted_at TEXT)")
        conn.exec_driver_sql("INSERT INTO orders VALUES (1, 1, 'a', NULL), (2, NULL, 'b', NULL)")
    poller = replace(make_poller(str(engine.url)), null_cursor="fail")
    store = MemoryStateStore("orders")
    with pytest.raises(CursorError, match="NULL"):
        run_tick(poller, SqlSource(poller), store, RecordingSink(), owner_id="a")
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is None


def test_a_naive_timestamp_cursor_without_a_timezone_is_refused(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 't.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, updated_at DATETIME NOT NULL)")
        conn.exec_driver_sql("INSERT INTO orders VALUES (1, '2026-01-01 10:00:00.000000')")
    poller = replace(make_poller(str(engine.url)), cursor="updated_at", soft_delete_column=None)
    store = MemoryStateStore("orders")
    with pytest.raises(CursorError, match="cursor_timezone"):
        run_tick(poller, SqlSource(poller), store, RecordingSink(), owner_id="a")
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is None


@pytest.mark.parametrize("garbage", [b"{not json", b'{"version": 99, "poller_name": "orders"}'])
def test_a_corrupt_or_future_state_blob_is_never_overwritten(established, garbage: bytes) -> None:
    _, poller, store, _ = established
    store.put_raw(garbage)
    with pytest.raises(StateFormatError):
        run_tick(poller, SqlSource(poller), store, RecordingSink(), owner_id="a")
    assert store.raw() == garbage


def test_storage_down_is_retryable_and_changes_nothing(established) -> None:
    _, poller, store, before = established
    store.unavailable = True
    with pytest.raises(StateUnavailableError) as info:
        run_tick(poller, SqlSource(poller), store, RecordingSink(), owner_id="a")
    assert info.value.retryable
    store.unavailable = False
    assert store.raw() == before


def test_a_changed_source_definition_refuses_to_run(established) -> None:
    _, poller, store, before = established
    changed = replace(poller, filter="id > 2")
    error = _fails(changed, SqlSource(changed), store, before, FingerprintMismatchError)
    assert "checkpoint reset" in error.hint
