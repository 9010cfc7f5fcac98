"""Replay is lossless under SIGKILL: every original is still dead-lettered, or its copy was delivered.

The replay runs as a real ``python -m dbfanout.cli dlq replay`` process and is killed with SIGKILL
at random points: during start-up, while receiving, and right after the k-th copy reached the
target queue (so between a send and its complete). After every kill the invariant is checked;
at the end a clean replay empties the DLQ and every original has at least one copy.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from dbfanout.ops.bus import peek_all
from dbfanout.ops.replay import PROP_REPLAY_OF, Selection, replay
from sbemulator.testing import unique_queue
from tests.cli.conftest import dead_letter
from tests.conftest import FULL
from tests.support.ports import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUNS = 100 if FULL else 20
SEED_BATCH = 6


def _kill_at_random_point(proc: subprocess.Popen[bytes], rng: random.Random, copies: int, count) -> str:
    """SIGKILL ``proc`` after a random delay, or once the target holds ``k`` more copies."""
    if rng.random() < 0.3:
        delay = rng.uniform(0.0, 1.5)
        time.sleep(delay)  # the kill point itself is what is random here, not a wait for a condition
        point = f"after {delay:.2f}s"
    else:
        k = rng.randint(1, 3)
        deadline = time.monotonic() + 30
        while count() < copies + k and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        point = f"after copy {k}"
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    return point


def _check_nothing_vanished(bus, source: str, target: str, originals: set[str], context: str) -> None:
    # DLQ first, then the target: a message completed before the first peek had its copy
    # accepted even earlier, so the second peek must see it.
    in_dlq = {v.message_id for v in peek_all(bus, source)}
    copied = {str(v.application_properties.get(PROP_REPLAY_OF)) for v in peek_all(bus, target, dead_letter=False)}
    vanished = originals - in_dlq - copied
    assert not vanished, f"{context}: lost {sorted(vanished)}"


def test_replay_killed_at_random_points_never_loses_a_message(workspace, bus, servicebus, tmp_path):
    # Given a DLQ that is refilled whenever a replay empties it, and a separate target queue
    rng = random.Random(int(os.environ.get("DBFANOUT_TEST_SEED", "0")) or random.randrange(1 << 30))
    source = unique_queue(servicebus, "poison", lock_duration=2, max_delivery_count=1)
    target = unique_queue(servicebus, "target", requires_duplicate_detection=True)
    originals: set[str] = set()
    command = [sys.executable, "-m", "dbfanout.cli", "dlq", "replay", source, "--all", "--to", target, "--yes",
               "--config", str(workspace.config_path)]  # fmt: skip
    kills = 0
    for run in range(RUNS):
        if servicebus.queue_stats(source)["dead_lettered"] == 0:
            bodies = [f'{{"run": {run}, "n": {i}}}'.encode() for i in range(SEED_BATCH)]
            originals |= set(dead_letter(bus, source, bodies, prefix=f"r{run}"))
        # When a replay process is killed at a random point
        copies = servicebus.queue_stats(target)["messages"]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
        point = _kill_at_random_point(proc, rng, copies, lambda: servicebus.queue_stats(target)["messages"])
        kills += proc.returncode == -signal.SIGKILL
        # Then nothing has vanished
        _check_nothing_vanished(bus, source, target, originals, f"run {run} killed {point}")
        print(run, point, proc.returncode, time.monotonic())
    assert kills >= RUNS // 2, "most runs should have been killed mid-way"
    # And a clean replay (once the killed runs' locks lapsed) empties the DLQ, every original copied
    def replay_rest() -> bool:
        replay(bus, source, Selection(everything=True), target=target)
        return servicebus.queue_stats(source)["dead_lettered"] == 0

    wait_until(replay_rest, 60, "the DLQ to be replayed completely", interval=0.5)
    _check_nothing_vanished(bus, source, target, originals, "after the final replay")
    copied = {str(v.application_properties.get(PROP_REPLAY_OF)) for v in peek_all(bus, target, dead_letter=False)}
    assert originals <= copied
    assert len(originals) >= 30
