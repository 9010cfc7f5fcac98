"""Quiet when idle (poller/tick/summary.py): per-tick lines by level, and the INFO summary at most
every few minutes, on a fake clock."""

from __future__ import annotations

import logging

import pytest

from poller.tick.summary import SUMMARY_SECONDS, TickSummary
from tests.poller.conftest import FakeClock


class Monotonic:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _info(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.INFO]


def test_a_day_of_idle_one_second_ticks_writes_one_info_line_per_five_minutes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mono, clock = Monotonic(), FakeClock()
    summary = TickSummary("p", monotonic=mono, clock=clock)
    with caplog.at_level(logging.DEBUG, logger="dbfanout"):
        # Given an hour of idle ticks, one a second
        for _ in range(3600):
            mono.now += 1
            clock.advance(1)
            summary.tick_done("caught_up", 0, 0)
    # Then each tick logged at DEBUG, and INFO holds only the summaries: one per 5 minutes
    assert len([r for r in caplog.records if r.getMessage() == "tick done"]) == 3600
    info = _info(caplog)
    assert len(info) == 3600 // SUMMARY_SECONDS == 12
    assert all(r.levelno == logging.INFO and r.getMessage().startswith("ticks since ") for r in info)
    first = info[0]
    assert first.ticks == 300 and first.idle_ticks == 300 and first.rows == 0  # type: ignore[attr-defined]


def test_a_tick_that_sent_rows_logs_at_info_and_the_summary_counts_it(caplog: pytest.LogCaptureFixture) -> None:
    mono = Monotonic()
    summary = TickSummary("p", monotonic=mono, every=60)
    with caplog.at_level(logging.DEBUG, logger="dbfanout"):
        summary.tick_done("caught_up", 25, 1)
        summary.tick_done("sink_refusing", 0, 0)  # backing off sends nothing: DEBUG
        mono.now = 61
        summary.tick_done("caught_up", 0, 0)
    info = _info(caplog)
    assert info[0].getMessage() == "tick done" and info[0].rows == 25  # type: ignore[attr-defined]
    [line] = [r for r in info if r.getMessage().startswith("ticks since")]
    assert line.ticks == 3 and line.idle_ticks == 2 and line.rows == 25  # type: ignore[attr-defined]
