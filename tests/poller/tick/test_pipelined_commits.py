"""The tick with group commits (``max_uncommitted_batches`` > 1): the seed's invariants hold.

* no row is lost;
* every checkpoint written is at the end of a page the sink already accepted (never ahead);
* after a failure, the pages sent again are only those accepted after the last landed write:
  at most ``max_uncommitted_batches`` of them.

Source: SQLite, 10 rows a page. State stores: the in-memory fake and the blob store on Azurite
(``harness`` fixture). Which pages one write covers depends on thread timing, so the tests make
it deterministic by holding writes (a hook around the store's ``commit``) or sends (the sink's
``before_accept``) on events; every wait has a timeout. With room for 4 pages a write starts at
3 pending pages, with room for 8 at 6.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from poller.ports import Page, Snapshot, StateStore
from poller.sources.keyset.source import SqlSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.config import PollerConfig
from shared.errors import CommitAmbiguousError, CommitError, EnqueueError
from shared.models import Batch, Checkpoint, Position
from tests.poller.conftest import FakeClock, StoreHarness
from tests.poller.tick_support import Crash, RecordingSink, SourceTable, drain, make_poller

TIMEOUT = 10.0  # a held write or send that waits longer than this fails the test
NOTHING_WITHIN = 0.2  # how long "the tick sends no further page" is watched (can only pass wrongly)
PAGE = 10  # rows a page (make_poller's batch_size)

Write = Callable[[], Snapshot]
Hook = Callable[[int, Checkpoint, Write], Snapshot]


@dataclass
class WatchedSink(RecordingSink):
    """A RecordingSink that other threads can wait on (``wait_accepted``)."""

    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def send(self, batch: Batch) -> None:
        super().send(batch)
        with self._cond:
            self._cond.notify_all()

    def wait_accepted(self, pages: int, timeout: float = TIMEOUT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.accepted) >= pages, timeout)

    def wait_room_full(self, pages: int) -> None:
        """Wait until ``pages`` pages were accepted and check the tick sends no further one."""
        assert self.wait_accepted(pages), f"the tick never sent page {pages}"
        assert not self.wait_accepted(pages + 1, NOTHING_WITHIN), f"the tick sent page {pages + 1}: no room limit"


class CommitSpy:
    """Wraps one store's ``commit``: counts the writes, records those that landed, checks each
    checkpoint against what the sink accepted when the write started, and lets ``hook(n,
    checkpoint, write)`` hold, fail or replace the n-th write (1-based)."""

    def __init__(self, store: StateStore, sink: RecordingSink, hook: Hook | None = None) -> None:
        self._real = store.commit
        self.sink = sink
        self.hook = hook
        self.calls = 0
        self.landed: list[Checkpoint] = []
        self.threads: list[int] = []
        self.ahead: list[str] = []  # violations of "never ahead of the sink"
        self._lock = threading.Lock()
        store.commit = self._commit  # type: ignore[method-assign]

    def _commit(self, snap: Snapshot, checkpoint: Checkpoint, ttl: object = None) -> Snapshot:
        with self._lock:
            self.calls += 1
            n = self.calls
            self.threads.append(threading.get_ident())
        problem = _ahead_of(checkpoint, self.sink)
        if problem:
            self.ahead.append(problem)

        def write() -> Snapshot:
            new = self._real(snap, checkpoint, ttl)  # type: ignore[arg-type]
            with self._lock:
                self.landed.append(checkpoint)
            return new

        return self.hook(n, checkpoint, write) if self.hook else write()


def _ahead_of(checkpoint: Checkpoint, sink: RecordingSink) -> str | None:
    """Why ``checkpoint`` is not the end of a page ``sink`` accepted (None when it is)."""
    accepted = list(sink.accepted)
    batch = next((b for b in accepted if b.batch_id == checkpoint.last_successful_batch_id), None)
    if batch is None:
        return f"checkpoint names batch {checkpoint.last_successful_batch_id}, not accepted by the sink"
    last = batch.events[-1]
    pos = checkpoint.position
    if pos is None or (pos.pk, pos.cursor) != (last.pk, last.cursor):
        return f"checkpoint {pos} is not the end of batch {batch.batch_id} ({last.pk}, {last.cursor})"
    return None


def _page_of(sink: RecordingSink, checkpoint: Checkpoint) -> int:
    """The 1-based page of ``sink`` that ``checkpoint`` ends."""
    return batch_ids(sink).index(str(checkpoint.last_successful_batch_id)) + 1


def end_of_page(page: int) -> tuple[int, int]:
    """(id, version) of the last row of ``page`` for a table filled by ``upsert(range(n))``."""
    return page * PAGE - 1, page * PAGE


def committed(store: StateStore) -> tuple[object, object] | None:
    snap = store.load()
    assert snap is not None
    pos = snap.doc.checkpoint.position
    return None if pos is None else (pos.pk["id"], pos.cursor)


def batch_ids(sink: RecordingSink) -> list[str]:
    return [b.batch_id for b in sink.accepted]


@pytest.fixture
def table(tmp_path: Path) -> SourceTable:
    return SourceTable(f"sqlite:///{tmp_path / 'src.db'}")


def _poller(table: SourceTable, depth: int) -> PollerConfig:
    return make_poller(str(table.engine.url), max_uncommitted_batches=depth)


# ------------------------------------------------------------------------------------------------
# Failures with pages in flight


def test_commit_failure_with_pages_in_flight_keeps_the_last_landed_write__W1(
    table: SourceTable, harness: StoreHarness
) -> None:
    clock = FakeClock()
    poller = _poller(table, 4)
    source = SqlSource(poller)
    table.upsert(range(100))
    store = harness.make(clock)
    sink = WatchedSink()

    def fail_the_second_write(n: int, checkpoint: Checkpoint, write: Write) -> Snapshot:
        if n == 2:
            # Given the tick has filled the room (4 pages past the first landed write) ...
            sink.wait_room_full(_page_of(sink, spy.landed[-1]) + 4)
            raise CommitError("injected: the group's checkpoint write failed")
        return write()

    spy = CommitSpy(store, sink, fail_the_second_write)
    # When the second write fails; Then the tick raises CommitError
    with pytest.raises(CommitError, match="injected"):
        run_tick(poller, source, store, sink, owner_id="a", clock=clock)
    # And the checkpoint stays at the first (landed) write, which covered 3 or 4 pages
    [first] = spy.landed
    covered = _page_of(sink, first)
    assert covered in (3, 4)
    assert committed(store) == end_of_page(covered)
    assert spy.calls == 2  # nothing written after the failure
    # And the sink accepted exactly the room past it: 4 pages
    assert len(sink.accepted) == covered + 4
    uncovered = batch_ids(sink)[covered:]
    # When the next tick drains; Then it re-sends those 4 pages (same ids) and nothing is lost
    spy.hook = None
    drain(poller, source, store, sink, clock=clock)
    assert set(sink.delivered()) == table.states()
    ids = batch_ids(sink)
    assert ids[covered + 4 : covered + 8] == uncovered
    assert len(ids) - len(set(ids)) == 4
    assert committed(store) == end_of_page(10)
    assert spy.ahead == []


def test_sink_failure_mid_tick_lands_every_page_accepted_before_it(table: SourceTable, harness: StoreHarness) -> None:
    clock = FakeClock()
    poller = _poller(table, 4)
    source = SqlSource(poller)
    table.upsert(range(100))
    store = harness.make(clock)
    sink = WatchedSink()

    def refuse_page_6(batch: Batch) -> None:
        if len(sink.accepted) == 5 and not refused:
            refused.append(batch)
            raise EnqueueError("broker refused page 6 (injected)")

    refused: list[Batch] = []
    sink.before_accept = refuse_page_6
    spy = CommitSpy(store, sink)
    # When the sink refuses page 6 (the last accepted pages may be pending: fewer than a group)
    with pytest.raises(EnqueueError):
        run_tick(poller, source, store, sink, owner_id="a", clock=clock)
    # Then the tick landed pages 1-5 before raising
    assert committed(store) == end_of_page(5)
    # And the next tick starts at page 6: no duplicate, nothing lost
    drain(poller, source, store, sink, clock=clock)
    assert sorted(sink.delivered()) == sorted(table.states())
    assert spy.ahead == []


def test_lost_lease_while_landing_the_accepted_pages_after_a_failure_is_logged__W4(
    table: SourceTable, harness: StoreHarness, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    poller = _poller(table, 4)
    source = SqlSource(poller)
    table.upsert(range(100))
    store = harness.make(clock)
    sink = WatchedSink()
    ttl = dt.timedelta(seconds=poller.lease_ttl_seconds)

    def steal_the_lease_then_refuse_page_3(batch: Batch) -> None:
        if len(sink.accepted) == 2:  # pages 1-2 accepted, not yet written (a write starts at 3)
            clock.advance(poller.lease_ttl_seconds + 10)
            assert harness.make(clock).try_acquire("b", ttl, source.fingerprint) is not None
            raise EnqueueError("broker refused page 3 (injected)")

    sink.before_accept = steal_the_lease_then_refuse_page_3
    caplog.set_level(logging.WARNING, logger="dbfanout")
    # When the sink refuses page 3 after another owner took the lease over
    with pytest.raises(EnqueueError):
        run_tick(poller, source, store, sink, owner_id="a", clock=clock)
    # Then the send failure propagates, nothing of A's was written ...
    snap = store.load()
    assert snap is not None and snap.doc.lease.owner_id == "b" and snap.doc.checkpoint.position is None
    # ... and the lost lease that kept pages 1-2 uncommitted was logged with its window and ids
    [record] = [r for r in caplog.records if r.getMessage().startswith("could not commit the pages")]
    assert vars(record)["window"] == "W4"
    assert vars(record)["poller"] == poller.name
    assert vars(record)["batch_id"] == batch_ids(sink)[1]
    assert vars(record)["fencing_token"] == 1


def test_crash_lands_nothing_past_the_write_in_flight_and_another_owner_resends_the_rest__W3(
    table: SourceTable, harness: StoreHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    poller = _poller(table, 8)  # a write starts at 6 pending pages
    source = SqlSource(poller)
    table.upsert(range(120))
    died = WatchedSink()
    first_write_started, crashed = threading.Event(), threading.Event()

    def hold_the_first_write_until_the_crash(n: int, checkpoint: Checkpoint, write: Write) -> Snapshot:
        if n == 1:
            first_write_started.set()
            assert crashed.wait(TIMEOUT)
        return write()

    def accept_page_8_then_die(batch: Batch) -> None:
        page = len(died.accepted) + 1
        if page == 7:
            assert first_write_started.wait(TIMEOUT)  # so the first write carries page 6 exactly
        if page == 8:
            died.accepted.append(batch)
            crashed.set()
            raise Crash("died after the broker accepted page 8")

    died.before_accept = accept_page_8_then_die
    store = harness.make(clock)
    spy = CommitSpy(store, died, hold_the_first_write_until_the_crash)
    # Given a process that dies (it never releases its lease) with pages 1-6 in a write in flight,
    # page 7 pending and page 8 accepted
    monkeypatch.setattr("poller.lease.keeper.LeaseKeeper.release", lambda self: None)
    with pytest.raises(Crash):
        run_tick(poller, source, store, died, owner_id="a", clock=clock)
    monkeypatch.undo()
    # Then only the write in flight landed: nothing was written for pages 7-8
    assert spy.calls == 1
    assert committed(store) == end_of_page(6)
    assert len(died.accepted) == 8
    # When another owner ticks before the lease expired; Then it must wait
    survivor = WatchedSink()
    assert drain(poller, source, harness.make(clock), survivor, owner_id="b", clock=clock)[-1].stop_reason == (
        "lease_held"
    )
    # When the lease expired; Then the new owner re-sends pages 7-8 only, and nothing is lost
    clock.advance(poller.lease_ttl_seconds + 10)
    store_b = harness.make(clock)
    spy_b = CommitSpy(store_b, survivor)
    drain(poller, source, store_b, survivor, owner_id="b", clock=clock)
    assert batch_ids(survivor)[:2] == batch_ids(died)[6:8]
    assert set(died.delivered()) & set(survivor.delivered()) == set(died.delivered()[6 * PAGE :])
    assert set(died.delivered()) | set(survivor.delivered()) == table.states()
    assert spy.ahead == [] and spy_b.ahead == []


def test_crash_during_a_write_with_the_room_full_resends_exactly_max_uncommitted_pages(
    table: SourceTable, harness: StoreHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    poller = _poller(table, 4)
    source = SqlSource(poller)
    table.upsert(range(100))
    died = WatchedSink()

    def die_during_the_first_write(n: int, checkpoint: Checkpoint, write: Write) -> Snapshot:
        died.wait_room_full(4)  # 4 pages accepted, none covered: the tick waits for room
        raise Crash("died while the first checkpoint write was in flight")

    store = harness.make(clock)
    spy = CommitSpy(store, died, die_during_the_first_write)
    monkeypatch.setattr("poller.lease.keeper.LeaseKeeper.release", lambda self: None)
    # When the process dies during the first write, with 4 pages accepted and none covered
    with pytest.raises(Crash):
        run_tick(poller, source, store, died, owner_id="a", clock=clock)
    monkeypatch.undo()
    # Then nothing was committed, and the tick stopped at the room's limit
    assert committed(store) is None
    assert spy.calls == 1 and spy.landed == []
    assert len(died.accepted) == 4
    # When the lease expired and another owner drains; Then it re-sends exactly those 4 pages
    clock.advance(poller.lease_ttl_seconds + 10)
    survivor = WatchedSink()
    drain(poller, source, harness.make(clock), survivor, owner_id="b", clock=clock)
    assert batch_ids(survivor)[:4] == batch_ids(died)
    assert sorted(survivor.delivered()) == sorted(table.states())


@pytest.mark.parametrize("landed", [True, False], ids=["applied", "lost"])
def test_ambiguous_group_commit_is_resolved_by_reloading__W5(
    table: SourceTable, harness: StoreHarness, landed: bool
) -> None:
    clock = FakeClock()
    poller = _poller(table, 4)
    source = SqlSource(poller)
    table.upsert(range(100))
    store = harness.make(clock)
    sink = WatchedSink()

    def ambiguous_first_write(n: int, checkpoint: Checkpoint, write: Write) -> Snapshot:
        if n != 1:
            return write()
        sink.wait_room_full(4)  # Given 4 pages in flight when the write's answer is lost
        if isinstance(store, MemoryStateStore):
            store.fail_next_commit("ambiguous_applied" if landed else "ambiguous_lost")  # the fake's own fault
            return write()
        if landed:  # the blob store: the same two outcomes, injected around the real write
            write()
        raise CommitAmbiguousError("injected: the response of the checkpoint write was lost")

    spy = CommitSpy(store, sink, ambiguous_first_write)
    if landed:
        # Then the tick reloads, sees its write landed, and goes on: every row once
        result = run_tick(poller, source, store, sink, owner_id="a", clock=clock)
        assert (result.stop_reason, result.rows, result.batches) == ("caught_up", 100, 10)
        assert sorted(sink.delivered()) == sorted(table.states())
    else:
        # Then the tick raises, nothing was committed, nothing written after the failed write
        with pytest.raises(CommitAmbiguousError):
            run_tick(poller, source, store, sink, owner_id="a", clock=clock)
        assert committed(store) is None
        assert spy.calls == 1
        assert len(sink.accepted) == 4
        # And the next tick re-sends exactly the 4 uncovered pages, nothing lost
        drain(poller, source, store, sink, clock=clock)
        ids = batch_ids(sink)
        assert ids[4:8] == ids[:4]
        assert len(ids) - len(set(ids)) == 4
        assert set(sink.delivered()) == table.states()
    assert committed(store) == end_of_page(10)
    assert spy.ahead == []


def test_lease_taken_over_mid_tick_the_stale_owner_writes_nothing_after__W4(
    table: SourceTable, harness: StoreHarness
) -> None:
    clock = FakeClock()
    poller = _poller(table, 4)
    source = SqlSource(poller)
    table.upsert(range(100))
    store_a = harness.make(clock)
    sink = WatchedSink()
    taken_over = threading.Event()
    blob_after_takeover: list[bytes | None] = []

    def hold_later_writes_until_the_takeover(n: int, checkpoint: Checkpoint, write: Write) -> Snapshot:
        if n >= 2:
            assert taken_over.wait(TIMEOUT)
        return write()

    def b_takes_over_while_a_sends_page_6(batch: Batch) -> None:
        if len(sink.accepted) == 5 and not taken_over.is_set():
            assert spy.landed, "page 5 was sent, so a write had landed"
            # A's lease lapses and B acquires it (B bumps the fencing token)
            clock.advance(poller.lease_ttl_seconds + 10)
            ttl = dt.timedelta(seconds=poller.lease_ttl_seconds)
            assert harness.make(clock).try_acquire("b", ttl, source.fingerprint) is not None
            blob_after_takeover.append(harness.raw())
            taken_over.set()

    sink.before_accept = b_takes_over_while_a_sends_page_6
    spy = CommitSpy(store_a, sink, hold_later_writes_until_the_takeover)
    result = run_tick(poller, source, store_a, sink, owner_id="a", clock=clock)
    # Then A stops with lease_lost, having landed only its first write
    assert result.stop_reason == "lease_lost" and result.rows == 0
    [first] = spy.landed
    covered = _page_of(sink, first)
    assert covered in (3, 4)
    # And A wrote nothing after the takeover: the blob is byte for byte what B's acquire left
    assert harness.raw() == blob_after_takeover[0]
    snap = harness.make(clock).load()
    assert snap is not None and (snap.doc.lease.owner_id, snap.doc.lease.fencing_token) == ("b", 2)
    assert committed(store_a) == end_of_page(covered)
    # And A sent at most 4 pages past its last landed write
    assert covered < len(sink.accepted) <= covered + 4
    # When B's lease lapses too and C drains; Then C starts after A's landed write: nothing lost
    clock.advance(poller.lease_ttl_seconds + 10)
    survivor = WatchedSink()
    drain(poller, source, harness.make(clock), survivor, owner_id="c", clock=clock)
    assert batch_ids(survivor)[0] == batch_ids(sink)[covered]
    assert set(sink.delivered()[: covered * PAGE]) | set(survivor.delivered()) == table.states()
    assert spy.ahead == []


# ------------------------------------------------------------------------------------------------
# Writes while catching up


def test_catching_up_writes_fewer_checkpoints_than_pages(table: SourceTable, harness: StoreHarness) -> None:
    clock = FakeClock()
    poller = _poller(table, 8)
    source = SqlSource(poller)
    table.upsert(range(200))
    store = harness.make(clock)
    sink = WatchedSink()
    spy = CommitSpy(store, sink)
    # When one tick catches up on 20 pages with room for 8 (writes start at 6 pending)
    result = run_tick(poller, source, store, sink, owner_id="a", clock=clock)
    assert (result.stop_reason, result.rows, result.batches) == ("caught_up", 200, 20)
    # Then far fewer writes than pages went out (about 4; at most every other page)
    assert 3 <= spy.calls <= 10, spy.calls
    # And on the committer's thread; the last one covers page 20; each row arrived once, in order
    assert threading.get_ident() not in spy.threads
    assert committed(store) == end_of_page(20)
    assert sink.delivered() == sorted(table.states(), key=lambda s: s[1])
    assert spy.ahead == []


def test_depth_one_commits_each_page_before_the_next_fetch(table: SourceTable, harness: StoreHarness) -> None:
    clock = FakeClock()
    poller = _poller(table, 1)
    source = SqlSource(poller)
    table.upsert(range(200))
    store = harness.make(clock)
    sink = WatchedSink()
    steps: list[str] = []
    real_fetch = source.fetch

    def logged_fetch(after: Position | None, limit: int) -> Page:
        steps.append("fetch")
        return real_fetch(after, limit)

    def logged_commit(n: int, checkpoint: Checkpoint, write: Write) -> Snapshot:
        steps.append(f"commit {_page_of(sink, checkpoint)}")
        return write()

    source.fetch = logged_fetch  # type: ignore[method-assign]
    sink.before_accept = lambda batch: steps.append(f"send {len(sink.accepted) + 1}")
    spy = CommitSpy(store, sink, logged_commit)
    result = run_tick(poller, source, store, sink, owner_id="a", clock=clock)
    assert (result.stop_reason, result.rows, result.batches) == ("caught_up", 200, 20)
    # Then exactly one commit per page, in the tick's own thread, in the strict order
    assert spy.calls == 20
    assert spy.threads == [threading.get_ident()] * 20
    assert steps == [s for p in range(1, 21) for s in ("fetch", f"send {p}", f"commit {p}")] + ["fetch"]
    assert committed(store) == end_of_page(20)
    assert spy.ahead == []
