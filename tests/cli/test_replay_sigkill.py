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
import uuid

import pytest
from azure.servicebus import ServiceBusMessage, ServiceBusSubQueue

from dbfanout.dlq.replay import PROP_REPLAY_OF, replay
from dbfanout.dlq.selection import Selection
from dbfanout.ops.bus import peek_receiver
from sbemulator.testing import unique_queue
from tests.conftest import FULL
from tests.support.ports import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUNS = 100 if FULL else 10
FIRST_SEED = 30
REFILL = 5


class Watch:
    """Long-lived links (opening one costs about a second): seed the DLQ and peek both queues."""

    def __init__(self, bus, source: str, target: str) -> None:
        self.source, self.target = source, target
        self.sender = bus.get_queue_sender(source)
        self.receiver = bus.get_queue_receiver(source, max_wait_time=5)
        self.dlq = bus.get_queue_receiver(source, sub_queue=ServiceBusSubQueue.DEAD_LETTER)
        self.copies = bus.get_queue_receiver(target)
        self.originals: set[str] = set()

    def seed(self, n: int, tag: str) -> None:
        ids = [f"{tag}-{i}-{uuid.uuid4().hex[:8]}" for i in range(n)]
        self.sender.send_messages([ServiceBusMessage(f'{{"n": "{i}"}}', message_id=i) for i in ids])
        got = 0
        while got < n:
            for message in self.receiver.receive_messages(max_message_count=n - got, max_wait_time=5):
                self.receiver.dead_letter_message(message, reason="HandlerFailed", error_description="test")
                got += 1
        self.originals |= set(ids)

    def check_nothing_vanished(self, context: str) -> set[str]:
        # DLQ first, then the target: a message completed before the first peek had its copy
        # accepted even earlier, so the second peek must see it.
        in_dlq = {v.message_id for v in peek_receiver(self.dlq)}
        copied = {str(v.application_properties.get(PROP_REPLAY_OF)) for v in peek_receiver(self.copies)}
        vanished = self.originals - in_dlq - copied
        assert not vanished, f"{context}: lost {sorted(vanished)}"
        return copied

    def close(self) -> None:
        for link in (self.sender, self.receiver, self.dlq, self.copies):
            link.close()


def _kill_at_random_point(proc: subprocess.Popen[bytes], rng: random.Random, copies: int, count) -> str:
    """SIGKILL ``proc`` after a random delay, or once the target holds ``k`` more copies."""
    if rng.random() < 0.3:
        delay = rng.uniform(0.0, 2.0)
        time.sleep(delay)  # the kill point itself is what is random here, not a wait for a condition
        point = f"after {delay:.2f}s"
    else:
        k = rng.randint(1, 2)
        deadline = time.monotonic() + 30
        while count() < copies + k and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        point = f"after copy {k}"
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    return point


def test_replay_killed_at_random_points_never_loses_a_message(workspace, bus, servicebus, tmp_path):
    # Given a DLQ of 30 messages (refilled if a replay empties it) and a separate target queue
    seed = int(os.environ.get("DBFANOUT_TEST_SEED", "0")) or random.randrange(1 << 30)
    rng = random.Random(seed)
    source = unique_queue(servicebus, "poison", lock_duration=2)
    target = unique_queue(servicebus, "target", requires_duplicate_detection=True)
    command = [
        sys.executable,
        "-m",
        "dbfanout.cli",
        "dlq",
        "replay",
        source,
        "--all",
        "--to",
        target,
        "--yes",
        "--config",
        str(workspace.config_path),
    ]
    watch = Watch(bus, source, target)
    try:
        watch.seed(FIRST_SEED, "first")
        kills = run = 0
        while run < RUNS or kills < RUNS // 2:  # at least half of them killed mid-way (some end first)
            run += 1
            assert run <= 3 * RUNS, f"seed {seed}: only {kills} of {run - 1} replays were still running at their kill"
            if servicebus.queue_stats(source)["dead_lettered"] == 0:
                watch.seed(REFILL, f"run{run}")
            # When a replay process is killed at a random point
            copies = servicebus.queue_stats(target)["messages"]
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
            point = _kill_at_random_point(proc, rng, copies, lambda: servicebus.queue_stats(target)["messages"])
            kills += proc.returncode == -signal.SIGKILL
            # Then nothing has vanished
            watch.check_nothing_vanished(f"seed {seed}, run {run} killed {point}")

        # And a clean replay (once the killed runs' locks lapsed) empties the DLQ, every original copied
        def replay_rest() -> bool:
            replay(bus, source, Selection(everything=True), target=target)
            return bool(servicebus.queue_stats(source)["dead_lettered"] == 0)

        wait_until(replay_rest, 60, "the DLQ to be replayed completely", interval=0.5)
        assert watch.originals <= watch.check_nothing_vanished(f"seed {seed}, after the final replay")
    finally:
        watch.close()
