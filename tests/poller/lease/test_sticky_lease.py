"""The sticky lease (StickyLease, poller/lease/keeper.py): a process keeps its poller's lease and
snapshot between ticks.

Idle ticks cost no storage request until a renewal is due; a stale cached snapshot (another
writer changed the blob) is found by the next write's CAS and reloaded; a lease taken over
after expiry while the old owner idles is left alone; release on shutdown frees it at once.
Stores: the in-memory fake and the blob store on Azurite (``harness``); source: SQLite.
"""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path
from typing import Any

import pytest
from azure.storage.blob import BlobServiceClient

from poller.lease.keeper import StickyLease
from poller.sources.keyset.source import SqlSource
from poller.state.blob import BlobStateStore
from poller.tick.lifecycle import run_tick
from shared.config import PollerConfig
from shared.errors import EnqueueError
from shared.models import Checkpoint, Lease, StateDoc
from tests.poller.conftest import APP, FakeClock, StoreHarness
from tests.poller.tick_support import RecordingSink, SourceTable, make_poller
from tests.support.azurite import Azurite

TTL_S = 30


@pytest.fixture
def table(tmp_path: Path) -> SourceTable:
    return SourceTable(f"sqlite:///{tmp_path / 'sticky.db'}")


@pytest.fixture
def poller(table: SourceTable) -> PollerConfig:
    return make_poller(str(table.engine.url), lease_ttl_seconds=TTL_S)


def _tick(poller: PollerConfig, source: SqlSource, lease: StickyLease, sink: RecordingSink, clock: FakeClock) -> Any:
    return run_tick(poller, source, lease.store, sink, owner_id=lease.owner_id, clock=clock, lease=lease)


def _lease(store: Any, owner: str, source: SqlSource, clock: FakeClock) -> StickyLease:
    return StickyLease(store, owner, dt.timedelta(seconds=TTL_S), source.fingerprint, clock=clock)


def test_the_owner_keeps_its_lease_between_ticks_and_renews_it_only_when_half_is_left(
    harness: StoreHarness, table: SourceTable, poller: PollerConfig, clock: FakeClock
) -> None:
    # Given an owner that delivered the table in its first tick
    table.upsert(range(3))
    source, sink = SqlSource(poller), RecordingSink()
    lease = _lease(harness.make(clock), "A", source, clock)
    assert _tick(poller, source, lease, sink, clock).rows == 3
    after_first = harness.raw()
    # When idle ticks follow while more than half the TTL is left
    for _ in range(14):
        clock.advance(1)
        assert _tick(poller, source, lease, sink, clock).stop_reason == "caught_up"
    # Then the state blob was not written (nor released): the lease still names A
    assert harness.raw() == after_first
    stored = harness.make(clock).load()
    assert stored is not None and stored.doc.lease.owner_id == "A"
    # When the lease has half its TTL left, Then the next tick renews it (same token)
    clock.advance(1)
    _tick(poller, source, lease, sink, clock)
    renewed = harness.make(clock).load()
    assert renewed is not None and renewed.doc.lease.fencing_token == stored.doc.lease.fencing_token
    assert renewed.doc.lease.expires_at == clock() + dt.timedelta(seconds=TTL_S)
    # And a row that appears is sent and committed under the kept lease
    table.upsert([3])
    assert _tick(poller, source, lease, sink, clock).rows == 1
    assert sorted(i for i, _ in sink.delivered()) == [0, 1, 2, 3]


def test_a_stale_cached_snapshot_fails_its_cas_and_the_next_tick_carries_on_from_the_stored_state(
    harness: StoreHarness, table: SourceTable, poller: PollerConfig, clock: FakeClock
) -> None:
    # Given A keeps the lease after delivering rows 0-4
    table.upsert(range(5))
    source, sink = SqlSource(poller), RecordingSink()
    lease = _lease(harness.make(clock), "A", source, clock)
    assert _tick(poller, source, lease, sink, clock).rows == 5
    # When another writer changes the blob under it: the checkpoint back to the beginning, lease free
    other = harness.make(clock)
    stored = other.load()
    assert stored is not None
    token = stored.doc.lease.fencing_token
    other.replace(
        stored,
        StateDoc(
            poller_name=stored.doc.poller_name,
            source_fingerprint=stored.doc.source_fingerprint,
            checkpoint=Checkpoint(),
            lease=Lease(owner_id=None, fencing_token=token + 1),
        ),
    )
    # And a row appears: A sends it from its cached position, and its commit fails the CAS
    table.upsert([5])
    clock.advance(1)
    assert _tick(poller, source, lease, sink, clock).stop_reason == "lease_lost"
    # Then the next tick reloads, takes the free lease with a higher token, and starts from there
    sink.accepted.clear()
    result = _tick(poller, source, lease, sink, clock)
    assert result.stop_reason == "caught_up" and result.rows == 6
    assert result.fencing_token == token + 2
    assert sorted(i for i, _ in sink.delivered()) == [0, 1, 2, 3, 4, 5]


def test_a_lease_taken_over_after_expiry_while_the_old_owner_idles_is_left_to_the_new_owner(
    harness: StoreHarness, table: SourceTable, poller: PollerConfig, clock: FakeClock
) -> None:
    # Given A keeps the lease, then stays away past its TTL and the skew margin (a paused process)
    table.upsert(range(2))
    source = SqlSource(poller)
    sink_a, sink_b = RecordingSink(), RecordingSink()
    a = _lease(harness.make(clock), "A", source, clock)
    assert _tick(poller, source, a, sink_a, clock).rows == 2
    clock.advance(TTL_S + 6)
    # When B takes the lapsed lease over and delivers a new row
    b = _lease(harness.make(clock), "B", source, clock)
    table.upsert([2])
    result_b = _tick(poller, source, b, sink_b, clock)
    assert result_b.rows == 1
    # Then A's next tick finds its renewal refused, reloads, and skips: the lease is B's
    sink_a.accepted.clear()
    table.upsert([3])
    assert _tick(poller, source, a, sink_a, clock).stop_reason == "lease_held"
    assert sink_a.accepted == []
    assert a.held is None
    # And B carries on under its kept lease
    assert _tick(poller, source, b, sink_b, clock).rows == 1
    stored = harness.make(clock).load()
    assert stored is not None and stored.doc.lease.owner_id == "B"
    assert stored.doc.lease.fencing_token == result_b.fencing_token


def test_release_on_shutdown_lets_another_owner_take_over_at_its_next_tick(
    harness: StoreHarness, table: SourceTable, poller: PollerConfig, clock: FakeClock
) -> None:
    # Given A keeps the lease, and B is refused while it does
    table.upsert(range(2))
    source = SqlSource(poller)
    a = _lease(harness.make(clock), "A", source, clock)
    b = _lease(harness.make(clock), "B", source, clock)
    assert _tick(poller, source, a, RecordingSink(), clock).rows == 2
    assert _tick(poller, source, b, RecordingSink(), clock).stop_reason == "lease_held"
    # When A stops gracefully
    a.release()
    # Then B's next tick (no time passed) takes the lease with the token bumped, from A's checkpoint
    table.upsert([2])
    sink_b = RecordingSink()
    result = _tick(poller, source, b, sink_b, clock)
    assert result.rows == 1 and [i for i, _ in sink_b.delivered()] == [2]


def test_a_failed_tick_gives_the_kept_lease_up(
    harness: StoreHarness, table: SourceTable, poller: PollerConfig, clock: FakeClock
) -> None:
    # Given A keeps the lease
    table.upsert(range(2))
    source = SqlSource(poller)
    a = _lease(harness.make(clock), "A", source, clock)
    assert _tick(poller, source, a, RecordingSink(), clock).rows == 2
    # When a tick fails (the broker refuses the batch)
    table.upsert([2])
    with pytest.raises(Exception, match="refused"):
        _tick(poller, source, a, RecordingSink(fail_next=1), clock)
    # Then the lease is released (another instance may do better) and nothing is kept
    assert a.held is None
    stored = harness.make(clock).load()
    assert stored is not None and stored.doc.lease.owner_id is None


# --------------------------------------------------------------------------------------------
# Storage requests, counted at the client (Azurite)


@pytest.mark.integration
def test_idle_ticks_cost_at_most_a_tenth_of_a_storage_request_each(
    azurite: Azurite, table: SourceTable, poller: PollerConfig, clock: FakeClock
) -> None:
    # Given a blob store whose client counts every request it sends
    requests: list[str] = []
    service = BlobServiceClient.from_connection_string(
        azurite.connection_string, raw_request_hook=lambda req: requests.append(req.http_request.method)
    )
    container = service.get_container_client(f"s-{uuid.uuid4().hex[:16]}")
    container.create_container()
    requests.clear()
    source, sink = SqlSource(poller), RecordingSink()
    lease = _lease(BlobStateStore(container, APP, poller.name, clock=clock), "A", source, clock)
    table.upsert(range(3))
    assert _tick(poller, source, lease, sink, clock).rows == 3  # acquire (read + create) + one commit
    first = len(requests)
    # When 100 idle ticks run, one a second (the 1 s schedule of the measurement)
    for _ in range(100):
        clock.advance(1)
        assert _tick(poller, source, lease, sink, clock).stop_reason == "caught_up"
    # Then only renewals went out: one write each 15 s (half the TTL), i.e. 0.06 requests a tick
    idle = requests[first:]
    assert set(idle) <= {"PUT"}
    assert len(idle) / 100 <= 0.1, idle
    assert len(idle) == 6  # at t = 15, 30, 45, 60, 75, 90 s


def test_the_owner_is_told_whenever_it_does_not_hold_the_lease_or_gives_it_up(
    harness: StoreHarness, table: SourceTable, poller: PollerConfig, clock: FakeClock
) -> None:
    # Given owner A, whose runtime wants to know when it stops holding the lease (to close LISTEN)
    told: list[str] = []
    source, sink = SqlSource(poller), RecordingSink()
    a = StickyLease(
        harness.make(clock), "A", dt.timedelta(seconds=TTL_S), source.fingerprint, clock=clock,
        on_not_owner=lambda: told.append("A"),
    )  # fmt: skip
    # When A ticks as the owner, Then nothing is said
    assert _tick(poller, source, a, sink, clock).stop_reason == "caught_up"
    assert told == []
    # When A pauses past the TTL and B takes the lease over, Then A's next tick tells A
    clock.advance(TTL_S + 10)
    assert _tick(poller, source, _lease(harness.make(clock), "B", source, clock), sink, clock).fencing_token == 2
    assert _tick(poller, source, a, sink, clock).stop_reason == "lease_held"
    assert told == ["A"]
    # When A holds it again and a tick fails (the sink refuses), Then A gave it up and is told so
    clock.advance(TTL_S + 10)
    table.upsert([1])
    sink.fail_next = 1
    with pytest.raises(EnqueueError):
        _tick(poller, source, a, sink, clock)
    assert told == ["A", "A"]
    # And a graceful stop tells it too
    assert _tick(poller, source, a, sink, clock).rows == 1
    a.release()
    assert told == ["A", "A", "A"]
