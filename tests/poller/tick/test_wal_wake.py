"""``wake = "wal"``: a pg_logical poller's linger wakes on commit without a trigger on the user's table.

The waker watches ``pg_current_wal_flush_lsn()`` every ``poll_interval_ms``; a commit moves it.
Servers: PostgreSQL 127.0.0.1:5432 for the waker alone (any wal_level), the logical-decoding
server (fixture ``pg_logical_url``) for the poller; state: the in-memory store; sink: recording.
"""

from __future__ import annotations

import time
import tomllib
from dataclasses import replace

import pytest
import sqlalchemy as sa

from dbfanout.ops.notify import missing_notify_triggers
from poller.sources.factory import open_source
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from poller.tick.wake import WalWaker
from shared.config import parse_config
from shared.errors import ConfigError
from tests.poller.pg_logical_support import logical_table
from tests.poller.source_fixtures import poller_config
from tests.poller.tick.test_linger import Background
from tests.poller.tick_support import RecordingSink
from tests.support.databases import unique_name
from tests.support.ports import wait_until

LOGICAL = """
[app]
name = "shop"

[pollers.orders]
kind = "pg_logical"
source_url = "postgresql+psycopg://u@h/db"
tables = ["public.orders"]
queue = "orders-changes"
linger_seconds = 4
wake = "wal"
"""


def test_wake_wal_is_for_lingering_pg_logical_pollers_only() -> None:
    # A lingering pg_logical poller may wake on the WAL
    assert parse_config(tomllib.loads(LOGICAL), {}).poller("orders").wake == "wal"
    # Not without a linger
    without_linger = LOGICAL.replace("linger_seconds = 4\n", "")
    with pytest.raises(ConfigError, match="set linger_seconds too"):
        parse_config(tomllib.loads(without_linger), {})
    # Not a keyset poller: the message says what it can use instead
    keyset = LOGICAL.replace('kind = "pg_logical"\n', "").replace(
        'tables = ["public.orders"]', 'table = "orders"\ncursor = "v"\npk = ["id"]'
    )
    with pytest.raises(ConfigError) as info:
        parse_config(tomllib.loads(keyset), {})
    assert info.value.key == "pollers.orders.wake" and 'kind = "pg_logical"' in info.value.problem
    assert 'wake = "notify"' in str(info.value.hint)


@pytest.mark.integration
def test_the_wal_waker_sees_a_commit_and_closes_its_connection(pg_url: str) -> None:
    # Given a waker watching the server's WAL flush position
    engine = sa.create_engine(pg_url)
    name = unique_name("walw")
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {name} (id bigint PRIMARY KEY)")
    waker = WalWaker(poller_config(pg_url, table=name, poll_interval_ms=20))
    try:
        waker.listen()
        assert waker.ready
        # When a row commits, Then the next wait returns at once (within a few of its looks)
        with engine.begin() as conn:
            conn.exec_driver_sql(f"INSERT INTO {name} VALUES (1)")
        started = time.monotonic()
        assert waker.wait(5.0) is True
        assert time.monotonic() - started < 1.0
        # When it is closed, Then it no longer waits (the linger polls)
        waker.close()
        assert not waker.ready and waker.wait(1.0) is False
    finally:
        waker.close()
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {name}")
        engine.dispose()


@pytest.mark.integration
def test_a_pg_logical_linger_with_wake_wal_sends_a_commit_at_once_with_no_trigger_on_the_table(
    pg_logical_url: str,
) -> None:
    with logical_table(pg_logical_url) as table:
        # Given a lingering pg_logical poller with wake = "wal", and no trigger on its table
        poller = replace(table.config, linger_seconds=5.0, poll_interval_ms=20, wake="wal")
        assert missing_notify_triggers(poller) == list(poller.tables)
        source, sink, store = open_source(poller), RecordingSink(), MemoryStateStore(poller.name)
        waker = WalWaker(poller)
        try:
            tick = Background(lambda: run_tick(poller, source, store, sink, owner_id="A", waker=waker))
            wait_until(lambda: waker.checks >= 2, 10, "the linger to watch the WAL")
            # When a row commits mid-linger
            table.insert([1])
            committed = time.monotonic()
            # Then the same tick sends it within a fraction of a second
            wait_until(lambda: len(sink.accepted) == 1, 5, "the woken change")
            assert time.monotonic() - committed < 1.0
            assert tick.running, "sent by the lingering tick, not a later one"
            assert tick.join(10).rows == 1
        finally:
            waker.close()
            source.close()
