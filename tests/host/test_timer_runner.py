"""TimerRunner's loop on a fake clock: which occurrences fire, and what each costs in schedule evaluations."""

from __future__ import annotations

import datetime as dt
import itertools
import threading
from typing import Any

from azure.functions.timer import TimerRequest

from dbfanout.host.app_loader import FunctionSpec
from dbfanout.host.schedule import Schedule
from dbfanout.host.timers import TimerRunner

T0 = dt.datetime(2026, 11, 26, 12, 0, 0, 300_000, tzinfo=dt.UTC)


class FakeTime(threading.Event):
    """The runner's clock and its stop event at once: each reading is ``step`` later than the one
    before (a call's duration), and waiting for the stop moves the clock instead of sleeping."""

    def __init__(self, step: dt.timedelta) -> None:
        super().__init__()
        self.now, self.step = T0, step

    def __call__(self) -> dt.datetime:
        self.now += self.step
        return self.now

    def wait(self, timeout: float | None = None) -> bool:
        if not self.is_set() and timeout is not None:
            self.now += dt.timedelta(seconds=timeout)
        return self.is_set()


def _run(schedule: str, firings: int, step: dt.timedelta) -> tuple[list[dt.datetime], int]:
    """Fire ``firings`` times; the "Next" of each call's schedule status, and the evaluations made."""
    nexts: list[dt.datetime] = []
    evaluations = [0]
    done = threading.Event()

    def fn(timer: TimerRequest) -> None:
        nexts.append(dt.datetime.fromisoformat(timer.schedule_status["Next"]))
        if len(nexts) == firings:
            runner.stop()
            done.set()

    fake = FakeTime(step)
    spec = FunctionSpec("t", {"type": "timerTrigger", "name": "timer", "schedule": schedule}, fn)
    runner = TimerRunner(spec, {}, clock=fake)
    runner._stop = fake  # waits move the fake clock
    real = runner.schedule

    def counted(when: dt.datetime) -> dt.datetime:
        evaluations[0] += 1
        return real.next_after(when)

    runner.schedule = _Counting(real, counted)  # type: ignore[assignment]
    runner.start()
    assert done.wait(10), f"{len(nexts)} of {firings} firings"
    assert runner.join(10)
    return nexts, evaluations[0]


class _Counting:
    """A schedule that counts its evaluations (Schedule is frozen)."""

    def __init__(self, real: Schedule, next_after: Any) -> None:
        self.interval, self.next_after, self.expression = real.interval, next_after, real.expression


def test_a_timer_evaluates_its_schedule_once_per_firing_and_fires_every_occurrence() -> None:
    # Given a timer every second, whose calls end long before the next occurrence
    nexts, evaluations = _run("*/1 * * * * *", firings=20, step=dt.timedelta(milliseconds=150))
    # Then it fired at every second in order, and evaluated its NCRONTAB expression once per firing
    # (the occurrence it computed for the status is the next one it waits for), plus the first
    assert [(b - a).total_seconds() for a, b in itertools.pairwise(nexts)] == [1.0] * 19
    assert evaluations <= 20 + 1


def test_occurrences_missed_by_a_long_call_are_skipped_not_queued() -> None:
    # Given a timer every second whose calls take longer than a second (each clock reading is 0.7 s later)
    nexts, evaluations = _run("*/1 * * * * *", firings=5, step=dt.timedelta(milliseconds=700))
    # Then the next firing is computed from the time the call ended: occurrences in between are skipped
    assert all((b - a).total_seconds() >= 2.0 for a, b in itertools.pairwise(nexts))
    assert evaluations >= 2 * 5 - 1


def test_a_timespan_schedule_counts_its_interval_from_the_end_of_the_call() -> None:
    # Given a TimeSpan timer of 5 s (the clock moves 2 s per reading)
    nexts, evaluations = _run("00:00:05", firings=4, step=dt.timedelta(seconds=2))
    # Then each wait starts after the call, not from the previous occurrence (every evaluation is made)
    assert all((b - a).total_seconds() > 5.0 for a, b in itertools.pairwise(nexts))
    assert evaluations == 2 * 4
