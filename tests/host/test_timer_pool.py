"""TimerPool: the local host's timers fire on a few shared threads, and long calls do not hold the others up."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Iterator

import pytest
from azure.functions.timer import TimerRequest

from dbfanout.host.app_loader import FunctionSpec
from dbfanout.host.timer_pool import TimerPool
from dbfanout.host.timers import TimerRunner
from tests.support.ports import wait_until


class Calls:
    """What one timer function saw: the thread and the lateness of each call."""

    def __init__(self, block: threading.Event | None = None) -> None:
        self.threads: list[int] = []
        self.late: list[float] = []
        self.block = block

    def __call__(self, timer: TimerRequest) -> None:
        self.threads.append(threading.get_ident())
        self.late.append((dt.datetime.now(dt.UTC) - _scheduled(timer)).total_seconds())
        if self.block is not None:
            self.block.wait(30)


def _scheduled(timer: TimerRequest) -> dt.datetime:
    """The occurrence a call is for: the one before "Next" (every schedule here is every second)."""
    return dt.datetime.fromisoformat(timer.schedule_status["Next"]) - dt.timedelta(seconds=1)


@pytest.fixture
def pool() -> TimerPool:
    return TimerPool(idle_seconds=0.5)


@pytest.fixture
def timers(pool: TimerPool) -> Iterator[Callable[[Calls], TimerRunner]]:
    """Start timers (every second) on one pool; stop and join them all at the end."""
    started = list[TimerRunner]()

    def start(fn: Calls) -> TimerRunner:
        spec = FunctionSpec(
            f"t{len(started)}", {"type": "timerTrigger", "name": "timer", "schedule": "* * * * * *"}, fn
        )
        runner = TimerRunner(spec, {}, pool=pool)
        runner.start()
        started.append(runner)
        return runner

    yield start
    for runner in started:
        runner.stop()
    assert all(runner.join(10) for runner in started)


def test_thirty_idle_timers_fire_every_second_on_a_few_threads(timers: Callable[[Calls], TimerRunner]) -> None:
    # Given 30 timers every second whose calls return at once
    calls = [Calls() for _ in range(30)]
    for fn in calls:
        timers(fn)
    # When each fired three times
    wait_until(lambda: all(len(c.threads) >= 3 for c in calls), 20, "three firings of each timer")
    # Then they shared a few threads (a thread per timer would be 30), and none was late by a second
    assert len({t for c in calls for t in c.threads}) <= 4
    assert max(late for c in calls for late in c.late) < 1.0


def test_a_call_that_blocks_does_not_hold_up_the_other_timers(timers: Callable[[Calls], TimerRunner]) -> None:
    # Given a timer whose call blocks, and one started after it on the same pool
    release = threading.Event()
    blocked, other = Calls(block=release), Calls()
    timers(blocked)
    wait_until(lambda: blocked.threads, 10, "the blocking call")
    timers(other)
    try:
        # When the blocking call is still running
        wait_until(lambda: len(other.threads) >= 3, 10, "three firings of the other timer")
        assert len(blocked.threads) == 1
    finally:
        release.set()
    # Then the other timer fired every second on another thread, late by about the pool's grace at most
    assert blocked.threads[0] not in other.threads
    assert max(other.late) < 0.5, other.late


def test_stop_lets_the_running_call_finish_and_fires_no_more(timers: Callable[[Calls], TimerRunner]) -> None:
    # Given a timer in a call
    release = threading.Event()
    calls = Calls(block=release)
    runner = timers(calls)
    wait_until(lambda: calls.threads, 10, "the call")
    # When it is stopped during the call
    runner.stop()
    # Then join waits for the call, which ends; no firing follows
    assert runner.join(0.2) is False
    release.set()
    assert runner.join(10)
    assert len(calls.threads) == 1


class FirstCallBlocks(Calls):
    """A timer whose first call waits for ``release`` (a first tick that reflects and acquires)."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release

    def __call__(self, timer: TimerRequest) -> None:
        super().__call__(timer)
        if len(self.threads) == 1:
            self.release.wait(30)


def test_workers_started_for_slow_calls_end_once_idle(pool: TimerPool, timers: Callable[[Calls], TimerRunner]) -> None:
    # Given five timers whose first calls block together: the pool starts a worker for each
    release = threading.Event()
    calls = [FirstCallBlocks(release) for _ in range(5)]
    for fn in calls:
        timers(fn)
    try:
        wait_until(lambda: all(c.threads for c in calls), 10, "the five first calls")
        assert pool.workers >= 5
    finally:
        release.set()
    # When the later calls return at once
    wait_until(lambda: all(len(c.threads) >= 3 for c in calls), 10, "two more firings of each")
    # Then the idle workers end, down to the one that keeps up (the timers still fire)
    wait_until(lambda: pool.workers == 1, 10, "the idle workers to end")
    counts = [len(c.threads) for c in calls]
    wait_until(lambda: all(len(c.threads) > n for c, n in zip(calls, counts, strict=True)), 10, "a firing each")


def test_the_pool_starts_no_more_workers_than_firings_wait(
    pool: TimerPool, timers: Callable[[Calls], TimerRunner]
) -> None:
    # Given twenty timers whose first calls all block (the pool grows while none returns)
    release = threading.Event()
    calls = [FirstCallBlocks(release) for _ in range(20)]
    for fn in calls:
        timers(fn)
    try:
        wait_until(lambda: all(c.threads for c in calls), 10, "the twenty first calls")
        # Then it started a worker per blocked call at most, not a doubling past them
        assert pool.threads_started <= 20
    finally:
        release.set()
