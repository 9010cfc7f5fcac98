"""A request is data, never a stall (issue 39): whatever a signal-table row holds, the poller's fetch
never raises, the request ends refused with its reason, and the stream flows in the same tick.

Anyone who can write the signal table can write a request row. Before, a ``where`` of 47 nested
parentheses raised RecursionError and a ``tables`` of ``5`` or ``true`` raised TypeError inside the
fetch: the checkpoint stayed before the row and every later tick failed the same way, for good.
Here hypothesis writes request rows (wrong JSON types, deep nesting, huge lists and ids, random
text) to the real signal table of a live pg_logical and a live mysql_binlog poller, with a change
after each, and every change must arrive. Examples: few by default, ``DBFANOUT_FULL_TESTS=1`` more.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poller.snapshot.mysql import mysql_request_statement, mysql_signal_sql, quote_mysql, signal_table
from poller.snapshot.postgres import request_statement
from poller.sources.mysql_binlog.source import MysqlBinlogSource
from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.memory import MemoryStateStore
from shared.config import PollerConfig
from shared.models import SnapshotState
from tests.conftest import FULL
from tests.poller.mysql_binlog_support import BinlogTables, binlog_tables
from tests.poller.mysql_binlog_support import events_of as binlog_events
from tests.poller.pg_logical_support import LogicalTable, events_of, logical_table, poller_config
from tests.poller.tick_support import RecordingSink, drain
from tests.support.databases import unique_name

pytestmark = pytest.mark.integration

EXAMPLES = 150 if FULL else 12
_DEEP = "(" * 47 + "id = 1" + ")" * 47

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=12,
)
_WHERE = st.one_of(
    st.sampled_from([_DEEP, "NOT " * 98 + "id = 1", "id BETWEEN SYMMETRIC 3 AND 1", "id = (SELECT 1)", "x" * 20_000]),
    _JSON,
)
_DATA = st.one_of(
    st.fixed_dictionaries(
        {"action": st.sampled_from(["snapshot", "cancel", "", "SNAPSHOT"]) | _JSON},
        optional={
            "tables": st.one_of(_JSON, st.just(["x"] * 5000), st.just("public.t"), st.integers(), st.booleans()),
            "where": _WHERE,
            "chunk_size": st.one_of(_JSON, st.just(10**12), st.just(0), st.just(-5), st.just(True)),
        },
    ).map(lambda d: json.dumps(d, ensure_ascii=False)),
    _JSON.map(json.dumps),
    st.just("[" * 5000 + "]" * 5000),
    st.text(max_size=200),
).map(lambda s: s.replace("\x00", ""))  # PostgreSQL's text holds no NUL: not a row anyone can write
_ID = st.one_of(st.text(min_size=1, max_size=150), st.just("r" * 190)).map(lambda s: s.replace("\x00", "") or "r")


# ---------------------------------------------------------------------------------------------- pg_logical


@pytest.fixture(scope="module")
def logical(pg_logical_url: str) -> Iterator[LogicalTable]:
    with logical_table(pg_logical_url) as table:
        yield table


def _assert_refused_or_ran(state: SnapshotState | None) -> None:
    # A refused request is a finished snapshot with its reason, bounded (it is in every checkpoint)
    if state is not None and state.error:
        assert not state.active and len(state.error) <= 400 and len(state.id) <= 128
        assert state.where is None or len(state.where) <= 200


_ids = itertools.count(1000)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=_DATA, request_id=_ID | st.just("r" * 10_000))
def test_pg_logical_any_request_row_leaves_the_stream_flowing(
    logical: LogicalTable, data: str, request_id: str
) -> None:
    config = poller_config(logical.url, logical.name, signal_table=logical.config.signal_table)
    store, sink = MemoryStateStore("p"), RecordingSink()
    drain(config, PgLogicalSource(config), store, sink)  # the checkpoint stands at the log's end
    # Given a request row holding anything, then a change
    statement, params = request_statement(config)
    with logical.engine.begin() as conn:
        conn.execute(statement, {**params, "id": request_id, "data": data})
    key = next(_ids)
    logical.insert([key], "after")
    # When the poller ticks (the fetch never raises: drain propagates any error)
    source = PgLogicalSource(config)
    try:
        drain(config, source, store, sink)
    finally:
        source.close()
    # Then the change after the request arrived, and a refused request is recorded, bounded
    assert key in {e.pk["id"] for e in events_of(sink.accepted)}
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    _assert_refused_or_ran(snap.doc.checkpoint.position.snapshot)


@pytest.mark.parametrize(
    "data",
    [
        {"action": "snapshot", "where": _DEEP},
        {"action": "snapshot", "where": "NOT " * 98 + "id = 1"},
        {"action": "snapshot", "tables": 5},
        {"action": "snapshot", "tables": True},
        {"action": "snapshot", "where": 42},
        {"action": "snapshot", "chunk_size": 10**12},
    ],
    ids=["47 parentheses", "98 NOTs", "tables 5", "tables true", "where 42", "huge chunk"],
)
def test_pg_logical_each_shape_that_stalled_a_poller_is_refused_with_its_reason(
    logical: LogicalTable, data: dict[str, Any]
) -> None:
    config = poller_config(logical.url, logical.name, signal_table=logical.config.signal_table)
    store, sink = MemoryStateStore("p"), RecordingSink()
    drain(config, PgLogicalSource(config), store, sink)
    statement, params = request_statement(config)
    with logical.engine.begin() as conn:
        conn.execute(statement, {**params, "data": json.dumps(data)})
    key = next(_ids)
    logical.insert([key], "after")
    drain(config, PgLogicalSource(config), store, sink)
    assert key in {e.pk["id"] for e in events_of(sink.accepted)}
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    state = snap.doc.checkpoint.position.snapshot
    assert state is not None and not state.active and state.error, state
    _assert_refused_or_ran(state)


# ---------------------------------------------------------------------------------------------- mysql_binlog


@pytest.fixture(scope="module")
def binlog(mysql_binlog_url: str) -> Iterator[BinlogTables]:
    with binlog_tables(mysql_binlog_url) as made:
        made.config = dataclasses.replace(
            made.config,
            name=unique_name("p"),
            signal_table=f"{made.database}.{made.name}_sig",
            tables=(made.qualified,),
            table=made.qualified,
        )
        with made.engine.begin() as conn:
            for statement in mysql_signal_sql(made.config):
                conn.execute(sa.text(statement))
        try:
            yield made
        finally:
            with made.engine.begin() as conn:
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {quote_mysql(signal_table(made.config))}"))


def _binlog_round(binlog: BinlogTables, config: PollerConfig, data: str, request_id: str) -> MemoryStateStore:
    store, sink = MemoryStateStore("p"), RecordingSink()
    source = MysqlBinlogSource(config)
    try:
        drain(config, source, store, sink)
        statement, params = mysql_request_statement(config)
        with binlog.engine.begin() as conn:
            conn.execute(statement, {**params, "id": request_id, "data": data})
        key = next(_ids)
        binlog.insert([key], "after")
        drain(config, source, store, sink)
    finally:
        source.close()
    assert key in {e.pk["id"] for e in binlog_events(sink.accepted)}
    return store


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=_DATA, request_id=_ID)
def test_mysql_binlog_any_request_row_leaves_the_stream_flowing(
    binlog: BinlogTables, data: str, request_id: str
) -> None:
    store = _binlog_round(binlog, binlog.config, data, request_id)
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    _assert_refused_or_ran(snap.doc.checkpoint.position.snapshot)


def test_mysql_binlog_a_deeply_nested_where_is_refused_with_its_reason(binlog: BinlogTables) -> None:
    store = _binlog_round(binlog, binlog.config, json.dumps({"action": "snapshot", "where": _DEEP}), "deep")
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    state = snap.doc.checkpoint.position.snapshot
    assert state is not None and not state.active and state.error and "nests more than" in state.error
