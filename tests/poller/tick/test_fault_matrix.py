"""The seed failure matrix (cases A-I, windows W1-W7) as tests of the real tick.

Each test injects one fault at the exact step and asserts: no row lost, the checkpoint never
ahead of what the sink accepted, duplicates only where the window says. State stores: the
in-memory fake and the blob store on Azurite (``harness`` fixture); source: SQLite. Commits run
inline and pipelined (``poller`` fixture); test_pipelined_commits.py covers the pipelined windows.
"""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pytest

from poller.lease.protocol import utcnow
from poller.ports import StateStore
from poller.sources.keyset.source import SqlSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.errors import CommitAmbiguousError, CommitError, EnqueueError, FingerprintMismatchError
from tests.poller.conftest import FakeClock, StoreHarness
from tests.poller.tick_support import Crash, RecordingSink, SourceTable, drain, make_poller


@pytest.fixture
def table(tmp_path: Path) -> SourceTable:
    return SourceTable(f"sqlite:///{tmp_path / 'src.db'}")


@pytest.fixture(params=["inline", "pipelined"])
def poller(table: SourceTable, request: pytest.FixtureRequest):
    """Each case runs with commits inline (max_uncommitted_batches = 1, the seed's strict order) and
    pipelined (the default); the per-batch duplicate counts of B and G are the inline ones."""
    if request.param == "inline":
        return make_poller(str(table.engine.url), max_uncommitted_batches=1)
    return make_poller(str(table.engine.url))


@pytest.fixture
def inline_poller(table: SourceTable):
    return make_poller(str(table.engine.url), max_uncommitted_batches=1)


@pytest.fixture
def source(poller) -> SqlSource:
    return SqlSource(poller)


def _committed_position(store: StateStore) -> tuple[object, object] | None:
    snap = store.load()
    assert snap is not None
    pos = snap.doc.checkpoint.position
    return None if pos is None else (pos.pk["id"], pos.cursor)


def test_happy_path_delivers_each_row_once_in_order(table, poller, source, store) -> None:
    # Given 35 rows; When ticking until caught up; Then each (id, version) once, in cursor order
    table.upsert(range(35))
    sink = RecordingSink()
    results = drain(poller, source, store, sink)
    assert sink.delivered() == sorted(table.states(), key=lambda s: s[1])
    assert sum(r.rows for r in results) == 35
    assert _committed_position(store) == (34, 35)


def test_sink_failure_keeps_the_checkpoint__case_A(table, poller, source, store) -> None:
    # Given rows and a sink that refuses the first send
    table.upsert(range(15))
    sink = RecordingSink(fail_next=1)
    # When a tick runs; Then EnqueueError and no checkpoint moved
    with pytest.raises(EnqueueError):
        run_tick(poller, source, store, sink, owner_id="a")
    assert _committed_position(store) is None
    # And the next tick delivers everything, nothing lost, no duplicate
    drain(poller, source, store, sink)
    assert sorted(sink.delivered()) == sorted(table.states())


def test_commit_failure_resends_the_same_batch__case_B_W1(table, inline_poller) -> None:
    poller, source = inline_poller, SqlSource(inline_poller)
    # The injected commit error needs the fake; Azurite's real outage is in test_state_blob_faults
    clock = FakeClock()
    store = MemoryStateStore("orders", clock=clock)
    table.upsert(range(25))
    sink = RecordingSink()
    # Given the second commit fails after its batch was accepted
    original_commit = store.commit
    calls = {"n": 0}

    def failing_second_commit(snap, checkpoint, ttl=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise CommitError("injected W1 commit failure")
        return original_commit(snap, checkpoint, ttl)

    store.commit = failing_second_commit  # type: ignore[method-assign]
    with pytest.raises(CommitError):
        run_tick(poller, source, store, sink, owner_id="a", clock=clock)
    # Then the checkpoint stays after batch 1, and the next tick re-sends batch 2 with the same id
    assert _committed_position(store) == (9, 10)
    drain(poller, source, store, sink, clock=clock)
    batch_ids = [b.batch_id for b in sink.accepted]
    assert batch_ids[1] == batch_ids[2]  # the identical re-send: duplicate detection drops it on the bus
    assert sorted(set(sink.delivered())) == sorted(table.states())
    assert len(sink.delivered()) == 25 + 10  # duplicates: exactly the one re-sent batch


def test_stale_owner_commit_is_rejected__case_C_W4(table, poller, source, harness: StoreHarness) -> None:
    clock = FakeClock()
    store_a, store_b = harness.make(clock), harness.make(clock)
    table.upsert(range(10))
    sink = RecordingSink()

    # Given A's lease lapses while its send is in flight, and B takes over and commits
    def b_takes_over(batch):
        if not sink.accepted:
            clock.advance(poller.lease_ttl_seconds + 10)
            drain(poller, source, store_b, sink_b, owner_id="b", clock=clock)

    sink_b = RecordingSink()
    sink.before_accept = b_takes_over
    # When A tries to commit; Then its lease is lost, nothing of A is written
    result = run_tick(poller, source, store_a, sink, owner_id="a", clock=clock)
    assert result.stop_reason == "lease_lost"
    snap = store_b.load()
    assert snap is not None and snap.doc.lease.fencing_token == 2
    assert _committed_position(store_b) == (9, 10)  # B's checkpoint, not overwritten by A
    assert sorted(sink_b.delivered()) == sorted(table.states())  # duplicates: A's batch, resent by B


def test_row_updated_again_delivers_its_latest_state__case_D(table, poller, source, store) -> None:
    table.upsert(range(3))
    sink = RecordingSink()
    drain(poller, source, store, sink)
    # When row 1 is updated twice between ticks; Then only its latest state is delivered again
    table.upsert([1], "v2")
    table.upsert([1], "v3")
    drain(poller, source, store, sink)
    assert sink.delivered()[-1] == (1, 5)
    assert [e.after["v"] for b in sink.accepted for e in b.events][-1] == "v3"  # type: ignore[index]


def test_crash_before_send_redelivers_after_lease_expiry__case_E_W2(
    table, poller, source, harness: StoreHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    table.upsert(range(12))
    # Given a process that dies right after fetch: a dead process never releases its lease
    monkeypatch.setattr("poller.lease.keeper.LeaseKeeper.release", lambda self: None)
    with pytest.raises(Crash):
        run_tick(poller, source, harness.make(clock), RecordingSink(crash_next=1), owner_id="a", clock=clock)
    monkeypatch.undo()
    survivor = RecordingSink()
    # When another owner ticks before the lease expired; Then it must wait
    assert (
        drain(poller, source, harness.make(clock), survivor, owner_id="b", clock=clock)[-1].stop_reason == "lease_held"
    )
    # When the lease expires; Then the next owner delivers every row
    clock.advance(poller.lease_ttl_seconds + 10)
    drain(poller, source, harness.make(clock), survivor, owner_id="b", clock=clock)
    assert sorted(survivor.delivered()) == sorted(table.states())


def test_crash_after_the_broker_accepted_resends_the_whole_batch__case_F_W3(
    table, poller, source, store, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    table.upsert(range(10))
    died = RecordingSink()

    def accept_then_die(batch):
        died.accepted.append(batch)
        raise Crash("died after the broker accepted, before the commit")

    died.before_accept = accept_then_die
    monkeypatch.setattr("poller.lease.keeper.LeaseKeeper.release", lambda self: None)
    with pytest.raises(Crash):
        run_tick(poller, source, store, died, owner_id="a", clock=clock)
    monkeypatch.undo()
    # When the dead owner's lease expires and another owner ticks; Then the batch is re-sent whole, same id
    clock.advance(poller.lease_ttl_seconds + 10)
    sink = RecordingSink()
    drain(poller, source, store, sink, owner_id="b", clock=clock)
    assert died.accepted[0].batch_id == sink.accepted[0].batch_id
    assert sorted(sink.delivered()) == sorted(table.states())


@pytest.mark.parametrize("landed", [True, False])
def test_ambiguous_commit_is_resolved_by_reloading__case_G_W5(table, inline_poller, landed: bool) -> None:
    poller, source = inline_poller, SqlSource(inline_poller)
    store = MemoryStateStore("orders")
    table.upsert(range(20))
    sink = RecordingSink()
    store.fail_next_commit("ambiguous_applied" if landed else "ambiguous_lost")
    if landed:
        # Then the tick sees its write landed and goes on: no duplicate
        drain(poller, source, store, sink)
        assert len(sink.delivered()) == 20
    else:
        with pytest.raises(CommitAmbiguousError):
            run_tick(poller, source, store, sink, owner_id="a")
        assert _committed_position(store) is None
        drain(poller, source, store, sink)
        assert len(sink.delivered()) == 30  # the first batch, re-sent once
    assert sorted(set(sink.delivered())) == sorted(table.states())


def test_lost_heartbeat_stops_before_commit__case_H(table, poller, source, harness: StoreHarness) -> None:
    clock = FakeClock()
    store_a = harness.make(clock)
    table.upsert(range(10))
    sink = RecordingSink()

    def thief(batch):
        # While A sends, its lease lapses and B acquires (B bumps the fencing token)
        clock.advance(poller.lease_ttl_seconds + 10)
        assert harness.make(clock).try_acquire("b", dt.timedelta(seconds=30), source.fingerprint) is not None

    sink.before_accept = thief
    result = run_tick(poller, source, store_a, sink, owner_id="a", clock=clock)
    assert result.stop_reason == "lease_lost" and result.rows == 0
    assert _committed_position(store_a) is None


def test_fingerprint_change_refuses_to_run_and_keeps_the_checkpoint(table, poller, source, store) -> None:
    table.upsert(range(5))
    drain(poller, source, store, RecordingSink())
    changed = SqlSource(
        poller.__class__(**{**{f: getattr(poller, f) for f in poller.__dataclass_fields__}, "filter": "id > 0"})
    )
    with pytest.raises(FingerprintMismatchError, match="checkpoint reset"):
        run_tick(poller, changed, store, RecordingSink(), owner_id="a")
    assert _committed_position(store) == (4, 5)


def test_restart_resumes_from_the_committed_checkpoint__W6(table, poller, source, store) -> None:
    table.upsert(range(10))
    first = RecordingSink()
    drain(poller, source, store, first)
    # When the app restarts (new source, new owner) and more rows arrive; Then only new rows come
    table.upsert(range(10, 15))
    second = RecordingSink()
    drain(poller, SqlSource(poller), store, second, owner_id="after-restart")
    assert sorted(second.delivered()) == [(i, i + 1) for i in range(10, 15)]


def test_updates_within_one_cursor_value_collapse__W7(table, poller, source, store) -> None:
    table.upsert([1], "first")
    # Given a second update that gets the same cursor value (precision collapse)
    table.upsert([1], "second", same_version=True)
    sink = RecordingSink()
    drain(poller, source, store, sink)
    # Then one event arrives, with the latest state only (documented in docs/cursors.md)
    assert [e.after["v"] for b in sink.accepted for e in b.events] == ["second"]  # type: ignore[index]


def test_soft_deleted_rows_arrive_as_delete_events(table, poller, source, store) -> None:
    table.upsert(range(3))
    table.soft_delete(1)
    sink = RecordingSink()
    drain(poller, source, store, sink)
    ops = {(e.pk["id"], e.op) for b in sink.accepted for e in b.events}
    assert ops == {(0, "upsert"), (2, "upsert"), (1, "delete")}


def test_a_fetch_slower_than_the_lease_keeps_the_lease__R11(table, harness: StoreHarness) -> None:
    # Given a 1 s lease and a database whose first fetch takes 2.5 s (real time, real clock)
    poller = make_poller(str(table.engine.url), lease_ttl_seconds=1)
    source = SqlSource(poller)
    table.upsert(range(5))
    rival_won: list[bool] = []
    real_fetch = source.fetch

    def slow_fetch(after, limit):
        if not rival_won:
            stalled_until = time.monotonic() + 2.5
            while time.monotonic() < stalled_until:  # a rival keeps trying to take the lease
                rival = harness.make(utcnow).try_acquire("rival", dt.timedelta(seconds=1), source.fingerprint)
                rival_won.append(rival is not None)
                time.sleep(0.05)
        return real_fetch(after, limit)

    source.fetch = slow_fetch  # type: ignore[method-assign]
    sink = RecordingSink()
    # When the tick runs; Then the background heartbeat kept the lease through the fetch
    result = run_tick(poller, source, harness.make(utcnow), sink, owner_id="a")
    assert result.stop_reason == "caught_up" and result.rows == 5
    assert rival_won and not any(rival_won)
    assert sorted(sink.delivered()) == sorted(table.states())
