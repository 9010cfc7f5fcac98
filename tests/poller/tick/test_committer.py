"""Committer: inline commits, group commits on one thread, the bounded lag, failures and close.

The commit function here is a plain recorder (no store, no database). Writes that must stay in
flight wait on an event the test sets; every wait has a timeout, so a broken committer fails a
test instead of hanging it. "Nothing happened" checks wait a short while (NOTHING_WITHIN): they
can only pass wrongly on a very slow machine, never fail wrongly.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import pytest

from poller.tick.committer import Committer, Landed

TIMEOUT = 10.0  # a gate or a background call that takes longer than this is a failure
NOTHING_WITHIN = 0.2  # how long a "no write starts / still blocked" check watches


class Boom(Exception):
    """The injected write failure."""


class Writes:
    """A commit function that records every write; ``held`` writes (1-based) wait for ``release``;
    the write numbered ``fail_at`` raises ``error`` (after the hold, if also held)."""

    def __init__(self, *, held: Collection[int] = (), fail_at: int | None = None) -> None:
        self.started: list[int] = []  # items, in the order their writes started
        self.landed: list[int] = []  # items whose write returned
        self.threads: list[int] = []  # thread ident of each write
        self.release = threading.Event()
        self.error = Boom("write failed (injected)")
        self._held = set(held)
        self._fail_at = fail_at
        self._cond = threading.Condition()

    def __call__(self, item: int) -> None:
        with self._cond:
            self.started.append(item)
            self.threads.append(threading.get_ident())
            n = len(self.started)
            self._cond.notify_all()
        if n in self._held:
            assert self.release.wait(TIMEOUT), f"write {n} was never released"
        if n == self._fail_at:
            raise self.error
        with self._cond:
            self.landed.append(item)
            self._cond.notify_all()

    def wait_started(self, n: int, timeout: float = TIMEOUT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.started) >= n, timeout)


class Background:
    """Runs ``fn`` on a daemon thread; remembers its result or exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def finished(self, timeout: float = TIMEOUT) -> bool:
        return self.done.wait(timeout)


def _flushed(committer: Committer[int]) -> Landed:
    """``committer.flush()``, failing (not hanging) when it does not return."""
    call = Background(committer.flush)
    assert call.finished(), "flush did not return"
    if call.error is not None:
        raise call.error
    assert isinstance(call.result, Landed)
    return call.result


def _committer(writes: Writes, max_uncommitted: int, name: str) -> Committer[int]:
    return Committer(writes, max_uncommitted, name=name)


def _wait_writer_stopped(name: str) -> None:
    """After a failed write: the writer stores the error and ends (the error is visible then)."""
    threads = [t for t in threading.enumerate() if t.name == name]
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive(), "the writer thread did not stop after a failed write"


# ------------------------------------------------------------------------------------------------
# Inline (max_uncommitted = 1): the strict fetch → send → commit order


def test_inline_commits_every_submit_in_order_in_the_callers_thread() -> None:
    # Given an inline committer (no thread)
    writes = Writes()
    before = {t.ident for t in threading.enumerate()}
    committer = _committer(writes, 1, "committer-inline")
    assert {t.ident for t in threading.enumerate()} == before  # no thread started
    # When three pages are submitted; Then each is written before submit returns, one write each
    for n, rows in enumerate([10, 10, 7], start=1):
        committer.wait_for_room()  # never blocks inline
        committer.submit(n, rows)
        assert writes.landed == list(range(1, n + 1))
        assert committer.landed == Landed(rows=[10, 20, 27][n - 1], batches=n)
    # And every write ran in the caller's thread
    assert writes.threads == [threading.get_ident()] * 3
    assert _flushed(committer) == Landed(rows=27, batches=3)
    committer.close()


def test_inline_write_failure_raises_from_submit_and_the_page_is_not_counted() -> None:
    writes = Writes(fail_at=2)
    committer = _committer(writes, 1, "committer-inline-fail")
    committer.submit(1, 10)
    # When the second write fails; Then submit raises it and the page is not landed
    with pytest.raises(Boom) as raised:
        committer.submit(2, 10)
    assert raised.value is writes.error
    assert committer.landed == Landed(rows=10, batches=1)
    assert writes.landed == [1]
    committer.close()


def test_max_uncommitted_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Committer(Writes(), 0)


# ------------------------------------------------------------------------------------------------
# Pipelined (max_uncommitted > 1): group commits on one background thread


def test_pipelined_write_starts_at_three_quarters_and_coalesces_pages_into_the_newest_item() -> None:
    # Given room for 8 pages (a write starts once 6 wait) and a first write held in flight
    writes = Writes(held={1})
    committer = _committer(writes, 8, "committer-group")
    try:
        # When 5 pages are submitted; Then no write starts yet
        for n in range(1, 6):
            committer.submit(n, n)
        assert not writes.wait_started(1, NOTHING_WITHIN)
        # When the 6th arrives; Then one write starts, carrying the newest item (6)
        committer.submit(6, 6)
        assert writes.wait_started(1)
        assert writes.started == [6]
        # And pages submitted while it is in flight wait for the next write
        committer.submit(7, 7)
        committer.submit(8, 8)
        assert committer.landed == Landed()  # nothing counts before the write returned
        writes.release.set()
        # Then flush writes 7-8 in one write carrying 8, and Landed sums every page's rows
        assert _flushed(committer) == Landed(rows=sum(range(1, 9)), batches=8)
        assert writes.started == [6, 8]
        assert writes.landed == [6, 8]
        # And the writes ran on the committer's thread, not the caller's
        assert threading.get_ident() not in writes.threads
    finally:
        writes.release.set()
        committer.close()


def test_landed_covers_a_write_only_after_it_returned() -> None:
    writes = Writes(held={1})
    committer = _committer(writes, 4, "committer-landed")
    try:
        for n in range(1, 4):
            committer.submit(n, 10)
        assert writes.wait_started(1)
        assert committer.landed == Landed()  # in flight is not landed
        writes.release.set()
        assert _flushed(committer) == Landed(rows=30, batches=3)
    finally:
        writes.release.set()
        committer.close()


def test_wait_for_room_blocks_at_exactly_max_uncommitted_pages_until_a_write_lands() -> None:
    # Given room for 4 pages and a first write (pages 1-3) held in flight
    writes = Writes(held={1})
    committer = _committer(writes, 4, "committer-room")
    try:
        for n in range(1, 4):
            committer.submit(n, 10)
        assert writes.wait_started(1)
        # When 3 pages are uncovered; Then there is room for a 4th
        assert Background(committer.wait_for_room).finished(), "wait_for_room blocked with 3 of 4 pages uncovered"
        # When the 4th is submitted (4 uncovered); Then wait_for_room blocks
        committer.submit(4, 10)
        waiter = Background(committer.wait_for_room)
        assert not waiter.finished(NOTHING_WITHIN), "wait_for_room returned with 4 of 4 pages uncovered"
        # When the write of pages 1-3 lands; Then the waiter is released, without error
        writes.release.set()
        assert waiter.finished(), "a landed write did not release wait_for_room"
        assert waiter.error is None
        assert committer.landed.batches >= 3
        assert _flushed(committer) == Landed(rows=40, batches=4)
    finally:
        writes.release.set()
        committer.close()


def test_wait_for_room_with_room_left_does_not_force_a_partial_write() -> None:
    # Given 2 pages pending of a group of 6 (room for 8)
    writes = Writes()
    committer = _committer(writes, 8, "committer-no-urge")
    try:
        committer.submit(1, 10)
        committer.submit(2, 10)
        # When the tick checks for room; Then it returns at once and no write starts (the group fills)
        assert Background(committer.wait_for_room).finished()
        assert not writes.wait_started(1, NOTHING_WITHIN)
        assert _flushed(committer) == Landed(rows=20, batches=2)
    finally:
        committer.close()


def test_flush_starts_a_write_before_the_group_is_full() -> None:
    # Given room for 8 pages (groups of 6) and only 2 pages submitted
    writes = Writes()
    committer = _committer(writes, 8, "committer-flush")
    try:
        committer.submit(1, 10)
        committer.submit(2, 5)
        assert not writes.wait_started(1, NOTHING_WITHIN)  # a partial group waits
        # When flushing; Then one write carries item 2 and flush returns what it covers
        flushing = Background(committer.flush)
        assert flushing.finished(), "flush did not start a write for a partial group"
        assert flushing.error is None
        assert flushing.result == Landed(rows=15, batches=2)
        assert writes.started == [2]
        # And a flush with nothing pending returns at once without writing
        assert _flushed(committer) == Landed(rows=15, batches=2)
        assert writes.started == [2]
    finally:
        committer.close()


@pytest.mark.parametrize("surfaces_from", ["submit", "wait_for_room", "flush"])
def test_a_write_failure_surfaces_from_the_next_step(surfaces_from: str) -> None:
    # Given a first write (pages 1-3) that fails
    name = f"committer-fail-{surfaces_from}"
    writes = Writes(fail_at=1)
    committer = _committer(writes, 4, name)
    try:
        for n in range(1, 4):
            committer.submit(n, 10)
        assert writes.wait_started(1)
        _wait_writer_stopped(name)
        # When the tick takes its next step; Then that step raises the stored failure itself
        step: Callable[[], object] = {
            "submit": lambda: committer.submit(4, 10),
            "wait_for_room": committer.wait_for_room,  # raises although there is room (3 of 4)
            "flush": committer.flush,
        }[surfaces_from]
        first = Background(step)
        assert first.finished(), f"{surfaces_from} hung after a failed write"
        assert first.error is writes.error
        # And it keeps raising; nothing is written or landed after the failure
        with pytest.raises(Boom):
            committer.submit(5, 10)
        again = Background(committer.flush)
        assert again.finished(), "flush hung after a failed write"
        assert again.error is writes.error
        assert writes.started == [3]
        assert writes.landed == []
        assert committer.landed == Landed()
    finally:
        committer.close()


@pytest.mark.parametrize("blocked_in", ["wait_for_room", "flush"])
def test_a_write_failure_releases_a_blocked_caller_with_the_error(blocked_in: str) -> None:
    # Given a full room (4 of 4) and the write of pages 1-3 held in flight, then failing
    writes = Writes(held={1}, fail_at=1)
    committer = _committer(writes, 4, f"committer-fail-blocked-{blocked_in}")
    try:
        for n in range(1, 4):
            committer.submit(n, 10)
        assert writes.wait_started(1)
        committer.submit(4, 10)
        blocked = Background(committer.wait_for_room if blocked_in == "wait_for_room" else committer.flush)
        assert not blocked.finished(NOTHING_WITHIN)
        # When the write fails; Then the blocked caller raises it (and does not hang)
        writes.release.set()
        assert blocked.finished(), f"{blocked_in} hung after a failed write"
        assert blocked.error is writes.error
        assert writes.landed == []
    finally:
        writes.release.set()
        committer.close()


def test_close_without_flush_leaves_pending_pages_unwritten() -> None:
    # Given 3 pages pending, fewer than a group (6 of 8)
    writes = Writes()
    committer = _committer(writes, 8, "committer-close")
    for n in range(1, 4):
        committer.submit(n, 10)
    # When closing without flush; Then the thread stops and nothing was written
    closing = Background(committer.close)
    assert closing.finished(), "close() did not stop the writer"
    assert writes.started == []
    assert committer.landed == Landed()
    assert not any(t.name == "committer-close" for t in threading.enumerate())


def test_close_lets_the_write_in_flight_land_but_writes_nothing_after_it() -> None:
    # Given a write of pages 1-6 in flight and page 7 pending
    writes = Writes(held={1})
    committer = _committer(writes, 8, "committer-close-inflight")
    for n in range(1, 7):
        committer.submit(n, 10)
    assert writes.wait_started(1)
    committer.submit(7, 10)
    # When closing (without flush) and the write in flight returns
    closing = Background(committer.close)
    assert not closing.finished(NOTHING_WITHIN)  # close waits for the write in flight
    writes.release.set()
    assert closing.finished(), "close() did not return after the write in flight"
    # Then that write landed, and page 7 was never written
    assert writes.started == [6]
    assert committer.landed == Landed(rows=60, batches=6)


@pytest.mark.parametrize("max_uncommitted", [2, 3, 4, 8])
def test_writes_follow_submission_order_and_carry_only_submitted_items(max_uncommitted: int) -> None:
    # Given a commit function with jittery latency, and the tick's pattern: wait for room, submit
    rng = random.Random(max_uncommitted)
    covered_before: list[int] = []  # pages covered when each write started
    submitted: list[int] = []
    committer: Committer[int]

    def commit(item: int) -> None:
        covered_before.append(committer.landed.batches)
        assert item in submitted, f"write of item {item} that was never submitted"
        time.sleep(rng.choice([0, 0, 0.0005, 0.002]))  # varies the interleaving only
        writes.append(item)

    writes: list[int] = []
    committer = Committer(commit, max_uncommitted, name=f"committer-order-{max_uncommitted}")
    try:
        rows_total = 0
        for n in range(1, 201):
            committer.wait_for_room()
            # Then at most max_uncommitted - 1 pages are uncovered when another may be sent
            assert len(submitted) - committer.landed.batches < max_uncommitted
            submitted.append(n)
            committer.submit(n, n % 7)
            rows_total += n % 7
        landed = _flushed(committer)
    finally:
        committer.close()
    # Then every write carried a submitted item, newer than the one before, ending with the last
    assert writes == sorted(set(writes))
    assert writes[-1] == 200
    # And each write covered exactly the pages up to its item: landed count == the previous item
    assert covered_before == [0, *writes[:-1]]
    assert landed == Landed(rows=rows_total, batches=200)


def test_flush_after_close_with_pending_pages_refuses_instead_of_hanging() -> None:
    committer: Committer[int] = Committer(lambda item: None, 8)
    committer.submit(1, rows=1)  # below the group: nothing written yet
    committer.close()
    with pytest.raises(RuntimeError, match="flush before close"):
        committer.flush()
