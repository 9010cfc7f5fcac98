"""``wake = "notify"``: only the lease's owner listens, and its LISTEN connection is always read.

A listening backend whose client does not read holds PostgreSQL's notification queue (one per
cluster) back; once the queue fills, every notifying commit of the application fails. So a
process closes its LISTEN connection as soon as it loses or gives up the lease, and the
connection is drained while it is open, whether a linger waits or not.

Source: PostgreSQL (127.0.0.1:5432, no logical decoding needed); state: the in-memory store
shared by two runtimes (two processes); sink: a recording sink.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import sqlalchemy as sa

from dbfanout.ops.notify import create_notify_triggers, drop_notify_triggers
from poller.runtime import PollerRuntime
from poller.state.memory import MemoryStateStore
from poller.tick.wake import notify_channel
from shared.config import AppConfig, Config, PollerConfig
from shared.errors import EnqueueError
from tests.poller.source_fixtures import poller_config
from tests.poller.tick_support import RecordingSink
from tests.support.databases import unique_name
from tests.support.ports import wait_until

pytestmark = pytest.mark.integration

#: Notifications of 4 KB each, far more than the socket buffers between a backend and its client.
BURST = 5000
PAYLOAD = 4000


@pytest.fixture
def notify_poller(pg_url: str) -> Iterator[PollerConfig]:
    """A keyset poller with wake = "notify" on its own table, its trigger created as --fix does."""
    engine = sa.create_engine(pg_url)
    name = unique_name("lsn")
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {name} (id bigint PRIMARY KEY, c bigint NOT NULL)")
    # A TTL of 1 s (below what config load accepts) lets a lease lapse within the test's bounds.
    poller = poller_config(
        pg_url, name=name, table=name, wake="notify", linger_seconds=0.3, poll_interval_ms=50, lease_ttl_seconds=1
    )
    create_notify_triggers(poller)
    try:
        yield poller
    finally:
        drop_notify_triggers(poller)
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {name}")
        engine.dispose()


def _runtime(poller: PollerConfig, store: MemoryStateStore, owner: str) -> PollerRuntime:
    config = Config(AppConfig("app"), {poller.name: poller})
    return PollerRuntime(config, poller.name, store=store, sink=RecordingSink(), owner_id=owner)


def _listeners(engine: sa.Engine, poller: PollerConfig) -> set[int]:
    """The backends whose last statement was the poller's LISTEN (pg_stat_activity)."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT pid FROM pg_stat_activity WHERE query = :listen"),
            {"listen": f"LISTEN {notify_channel(poller)}"},
        )
        return set(rows.scalars())


def _queue_usage(engine: sa.Engine) -> float:
    with engine.connect() as conn:
        return float(conn.exec_driver_sql("SELECT pg_notification_queue_usage()").scalar_one())


def _notify(engine: sa.Engine, channel: str, count: int) -> None:
    """``count`` distinct notifications in one commit (PostgreSQL folds duplicates only)."""
    with engine.begin() as conn:
        conn.execute(
            sa.text("SELECT pg_notify(:channel, repeat('x', :size) || i) FROM generate_series(1, :n) AS i"),
            {"channel": channel, "size": PAYLOAD, "n": count},
        )


def test_a_former_owner_closes_its_listen_connection_when_another_owner_took_the_lease_over(
    notify_poller: PollerConfig, pg_url: str
) -> None:
    # Given owner A, which listened during its lingering tick and keeps the lease (and LISTEN) after it
    store = MemoryStateStore(notify_poller.name)
    a, b = _runtime(notify_poller, store, "A"), _runtime(notify_poller, store, "B")
    engine = sa.create_engine(pg_url)
    try:
        assert a.tick().stop_reason == "caught_up"
        (a_backend,) = _listeners(engine, notify_poller)
        # When A's lease lapses (A paused) and B takes it over
        wait_until(lambda: b.tick().stop_reason != "lease_held", 10, "B to take the lapsed lease over")
        (b_backend,) = _listeners(engine, notify_poller) - {a_backend}
        assert a_backend in _listeners(engine, notify_poller), "A cannot know yet: it has not ticked since"
        # Then A's next tick finds the lease taken, and A's LISTEN backend is gone at once
        assert a.tick().stop_reason == "lease_held"
        wait_until(lambda: a_backend not in _listeners(engine, notify_poller), 2, "A's LISTEN backend to end")
        # While B, the owner, listens
        assert _listeners(engine, notify_poller) == {b_backend}
    finally:
        a.close()
        b.close()
        engine.dispose()


def test_a_failed_tick_gives_the_lease_up_and_closes_its_listen_connection(
    notify_poller: PollerConfig, pg_url: str
) -> None:
    # Given an owner listening after a lingering tick
    store = MemoryStateStore(notify_poller.name)
    owner = _runtime(notify_poller, store, "A")
    engine = sa.create_engine(pg_url)
    try:
        assert owner.tick().stop_reason == "caught_up"
        (backend,) = _listeners(engine, notify_poller)
        # When its next tick fails (the sink refuses a batch), releasing the lease
        with engine.begin() as conn:
            conn.exec_driver_sql(f"INSERT INTO {notify_poller.table} (id, c) VALUES (1, 1)")
        sink = owner.sink
        assert isinstance(sink, RecordingSink)
        sink.fail_next = 1
        with pytest.raises(EnqueueError):
            owner.tick()
        # Then its LISTEN backend is gone too
        wait_until(lambda: backend not in _listeners(engine, notify_poller), 2, "the LISTEN backend to end")
    finally:
        owner.close()
        engine.dispose()


def test_the_owners_listen_connection_is_drained_between_ticks_so_the_notification_queue_empties(
    notify_poller: PollerConfig, pg_url: str
) -> None:
    # Given the lease's owner between two ticks: listening, but no linger waiting on it
    owner = _runtime(replace(notify_poller, lease_ttl_seconds=30), MemoryStateStore(notify_poller.name), "A")
    engine = sa.create_engine(pg_url)
    try:
        assert owner.tick().stop_reason == "caught_up"
        assert len(_listeners(engine, notify_poller)) == 1
        channel = notify_channel(notify_poller)
        # When commits notify its channel with far more than a connection's buffers hold
        _notify(engine, channel, BURST)
        # Then the queue empties again as later notifying commits move its tail (nothing pins it)
        burst_share = BURST * PAYLOAD / (8 * 1024**3)  # the burst's part of the 8 GB queue

        def emptied() -> bool:
            _notify(engine, channel, 20)  # ~10 queue pages: the committing backend advances the tail
            return _queue_usage(engine) < burst_share / 10

        wait_until(emptied, 20, "the notification queue to empty")
    finally:
        owner.close()
        engine.dispose()
