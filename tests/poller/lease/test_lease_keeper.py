"""LeaseKeeper: heartbeat by remaining time (R11), background renewal, lost and ambiguous writes."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from poller.lease.keeper import LeaseKeeper
from poller.lease.protocol import utcnow
from poller.lease.renewer import RENEWALS
from poller.ports import Snapshot, StateStore
from poller.state.memory import MemoryStateStore
from shared.errors import CommitAmbiguousError, CommitError, LostLeaseError, StateUnavailableError
from shared.models import Checkpoint, Position
from tests.poller.conftest import FINGERPRINT, FakeClock, StoreHarness
from tests.support.ports import wait_until

TTL = dt.timedelta(seconds=30)
SKEW = dt.timedelta(seconds=5)


def _cp(n: int) -> Checkpoint:
    return Checkpoint(Position(cursor=n, pk={"id": n}), last_successful_batch_id=f"batch_{n}")


def _acquire(store: StateStore, owner: str = "A", ttl: dt.timedelta = TTL) -> Snapshot:
    snap = store.try_acquire(owner, ttl, FINGERPRINT)
    assert snap is not None
    return snap


@pytest.fixture
def memory(clock: FakeClock) -> MemoryStateStore:
    return MemoryStateStore("orders", clock=clock)


@pytest.fixture
def keeper(memory: MemoryStateStore, clock: FakeClock) -> LeaseKeeper:
    return LeaseKeeper(memory, _acquire(memory), TTL, clock=clock)


def test_heartbeat_goes_out_only_when_less_than_half_the_ttl_remains__R11(
    keeper: LeaseKeeper, memory: MemoryStateStore, clock: FakeClock
) -> None:
    # Given a fresh 30 s lease (one write so far)
    writes = memory.blob.writes
    # When 14.9 s have passed (15.1 s remain), Then no heartbeat
    clock.advance(14.9)
    assert keeper.heartbeat_if_due() is False and memory.blob.writes == writes
    # When 15.1 s have passed (14.9 s remain), Then one heartbeat extends it to now + ttl
    clock.advance(0.2)
    assert keeper.heartbeat_if_due() is True and memory.blob.writes == writes + 1
    assert keeper.snapshot.doc.lease.expires_at == clock() + TTL
    # And right after, nothing is due again
    assert keeper.heartbeat_if_due() is False and memory.blob.writes == writes + 1


def test_commit_extends_the_lease_in_one_write_so_a_batch_costs_at_most_two(
    memory: MemoryStateStore, clock: FakeClock
) -> None:
    # Given a tick that acquired the lease (write 1)
    keeper = LeaseKeeper(memory, _acquire(memory), TTL, clock=clock)
    assert memory.blob.writes == 1
    # When a batch is committed 25 s later (past the heartbeat threshold)
    clock.advance(25)
    keeper.commit(_cp(1))
    # Then that one write (2) moved the checkpoint and extended the lease, so no heartbeat is due
    assert memory.blob.writes == 2
    assert keeper.checkpoint == _cp(1) and keeper.snapshot.doc.lease.expires_at == clock() + TTL
    assert keeper.heartbeat_if_due() is False and keeper.fencing_token == 1
    assert memory.load() == keeper.snapshot


def test_background_renewal_keeps_the_lease_alive_across_a_send_longer_than_the_ttl(harness: StoreHarness) -> None:
    # Given A holds a 2 s lease (real time) and B keeps trying to take it
    ttl = dt.timedelta(seconds=2)
    a, b = harness.make(utcnow), harness.make(utcnow)
    keeper = LeaseKeeper(a, _acquire(a, "A", ttl), ttl, clock=utcnow)
    rival_wins: list[Snapshot] = []

    def rival_tries_and_send_is_done(started: float) -> bool:
        snap = b.try_acquire("B", ttl, FINGERPRINT)
        if snap is not None:
            rival_wins.append(snap)
        return bool(rival_wins) or time.monotonic() - started > 3.5

    # When a send runs for 3.5 s (longer than the TTL plus the skew margin) with background renewal
    with keeper.renewing_in_background(interval=0.1):
        started = time.monotonic()
        wait_until(lambda: rival_tries_and_send_is_done(started), 20, "the slow send")
    # Then B never got the lease, and A commits with its original fencing token
    assert rival_wins == []
    keeper.check()
    snap = keeper.commit(_cp(1))
    assert snap.doc.lease.owner_id == "A" and snap.doc.lease.fencing_token == 1


def test_a_lost_heartbeat_makes_the_next_commit_raise_without_writing__case_H_W4(
    harness: StoreHarness, clock: FakeClock
) -> None:
    # Given A's lease lapsed while it was busy, and B took it over
    a, b = harness.make(clock), harness.make(clock)
    keeper = LeaseKeeper(a, _acquire(a, "A"), TTL, clock=clock)
    clock.advance((TTL + SKEW).total_seconds())
    _acquire(b, "B")
    before = harness.raw()
    # When A's background renewer heartbeats
    with keeper.renewing_in_background(interval=0.01):
        wait_until(lambda: keeper.lost is not None, 10, "the renewer to see the lost lease")
    # Then the loss is stored, and the next commit raises it without writing
    assert keeper.lost is not None and keeper.lost.window == "W4"
    with pytest.raises(LostLeaseError):
        keeper.commit(_cp(1))
    with pytest.raises(LostLeaseError):
        keeper.check()
    assert harness.raw() == before
    # And release leaves B's lease alone, without raising
    keeper.release()
    assert harness.raw() == before


def test_an_ambiguous_commit_that_landed_resolves_true__case_G_W5(
    keeper: LeaseKeeper, memory: MemoryStateStore, clock: FakeClock
) -> None:
    # Given the commit's response was lost after the write landed
    memory.fail_next_commit("ambiguous_applied")
    with pytest.raises(CommitAmbiguousError):
        keeper.commit(_cp(1))
    # While in doubt: no heartbeat and no commit go out
    writes = memory.blob.writes
    clock.advance(25)
    assert keeper.heartbeat_if_due() is False
    with pytest.raises(CommitError):
        keeper.commit(_cp(2))
    assert memory.blob.writes == writes
    # When resolved, Then True, the stored ETag is adopted and the tick goes on
    assert keeper.resolve_ambiguous(_cp(1)) is True
    assert keeper.snapshot == memory.load() and keeper.checkpoint == _cp(1)
    keeper.commit(_cp(2))
    assert memory.load() == keeper.snapshot


def test_an_ambiguous_commit_that_did_not_land_resolves_false__case_G_W5(
    keeper: LeaseKeeper, memory: MemoryStateStore
) -> None:
    # Given the commit timed out before it landed
    before = keeper.snapshot
    memory.fail_next_commit("ambiguous_lost")
    with pytest.raises(CommitAmbiguousError):
        keeper.commit(_cp(1))
    # When resolved, Then False: the lease is still ours, the checkpoint did not move
    assert keeper.resolve_ambiguous(_cp(1)) is False
    assert keeper.snapshot == before == memory.load()
    # And the batch can be committed again
    keeper.commit(_cp(1))
    assert memory.load() == keeper.snapshot


def test_an_ambiguous_commit_whose_lease_moved_resolves_to_lost_lease__case_G_W4(
    keeper: LeaseKeeper, memory: MemoryStateStore, clock: FakeClock
) -> None:
    # Given an unresolved commit, and meanwhile B took the lapsed lease
    memory.fail_next_commit("ambiguous_lost")
    with pytest.raises(CommitAmbiguousError):
        keeper.commit(_cp(1))
    clock.advance((TTL + SKEW).total_seconds())
    _acquire(memory.peer(), "B")
    # When resolving, Then LostLeaseError, and it sticks
    with pytest.raises(LostLeaseError):
        keeper.resolve_ambiguous(_cp(1))
    with pytest.raises(LostLeaseError):
        keeper.commit(_cp(1))


def test_a_plain_commit_failure_leaves_the_etag_valid__case_B_W1(keeper: LeaseKeeper, memory: MemoryStateStore) -> None:
    # Given a commit failed for sure (nothing written)
    memory.fail_next_commit("error")
    with pytest.raises(CommitError) as info:
        keeper.commit(_cp(1))
    assert type(info.value) is CommitError and info.value.window == "W1"
    # When the batch is committed again, Then it lands
    keeper.commit(_cp(1))
    assert memory.load() == keeper.snapshot


def test_a_heartbeat_of_unknown_outcome_is_reconciled_not_mistaken_for_a_lost_lease(
    keeper: LeaseKeeper, memory: MemoryStateStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a heartbeat that landed but whose answer was lost
    original = memory.heartbeat

    def landed_then_timed_out(snap: Snapshot, ttl: dt.timedelta) -> Snapshot:
        original(snap, ttl)
        raise StateUnavailableError("heartbeat: the write may have landed")

    monkeypatch.setattr(memory, "heartbeat", landed_then_timed_out)
    clock.advance(25)
    with pytest.raises(StateUnavailableError):
        keeper.heartbeat_if_due()
    # When the tick commits, Then the keeper reloads, sees the lease is still ours, and commits
    keeper.commit(_cp(1))
    assert keeper.lost is None and memory.load() == keeper.snapshot


def test_release_is_best_effort_and_makes_the_lease_free(
    keeper: LeaseKeeper, memory: MemoryStateStore, clock: FakeClock
) -> None:
    # Given storage is down, When releasing, Then nothing raises
    memory.unavailable = True
    keeper.release()
    # Given storage is back, When releasing, Then the lease is free at once
    memory.unavailable = False
    keeper.release()
    stored = memory.load()
    assert stored is not None and stored.doc.lease.owner_id is None
    assert _acquire(memory.peer(), "B").doc.lease.fencing_token == 2


def test_a_keeper_needs_a_held_lease(memory: MemoryStateStore) -> None:
    # Given a released snapshot, When a keeper is made from it, Then ValueError
    released = memory.release(_acquire(memory))
    with pytest.raises(ValueError):
        LeaseKeeper(memory, released, TTL)


def test_ticks_shorter_than_the_renewal_interval_do_not_wake_the_renewer_thread(keeper: LeaseKeeper) -> None:
    # Given the process's renewer thread, started by a first tick that renews every 5 s
    with keeper.renewing_in_background(interval=5.0):
        pass
    wakes = RENEWALS.wakes
    # When 100 idle ticks each hold their keeper for 1 ms (their read; the thread could run meanwhile)
    for _ in range(100):
        with keeper.renewing_in_background(interval=5.0):
            time.sleep(0.001)
    # Then the thread woke at most for its own look at the end of an earlier, shorter wait: not per tick
    assert RENEWALS.wakes - wakes <= 2
