"""``dbfanout run`` under a crash storm: only poison rows reach the dead-letter queue.

Crashes use up deliveries without a failure the worker can see. Here the host is SIGKILLed at
random moments, and also - deterministically - every time its handler is given a poison row in a
multi-event batch (a row that kills the process rather than raising). With the queue's
MaxDeliveryCount 3 (``max_delivery_count = 3``), the worker must split such a batch before its
handler runs again (worker.settlement.split_first), and split a batch that raises on its first
failure, or the crashes dead-letter it whole, its healthy rows with it.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from azure.servicebus import ServiceBusClient, ServiceBusSubQueue

from sbemulator import Emulator
from sbemulator.testing import unique_queue
from shared.codec import decode_batch
from tests.conftest import FULL
from tests.host.app_support import SOURCE_DDL, AppDir, HostProcess, Target, sqlite_engine, wait_for
from tests.support.azurite import Azurite

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROWS = 3_000 if FULL else 300
KILLS = 20 if FULL else 4
POISON = {37, ROWS - 11}

CRASHY_HANDLER = '''
"""The example handler: a poison row in a batch kills the host; a poison row alone raises."""
import os
import signal

from handlers.example import handle as replicate


def handle(events, context):
    poison = [e for e in events if (e.after or {}).get("v") == "poison"]
    if poison and len(events) > 1:
        os.kill(os.getpid(), signal.SIGKILL)  # the host dies holding the batch: a delivery used up
    if poison:
        raise ValueError(f"poison rows {[e.pk for e in poison]}")
    replicate(events, context)
'''


def test_only_poison_rows_reach_the_dlq_when_crashes_use_up_deliveries(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator
) -> None:
    # Given a queue with MaxDeliveryCount 3, a poller told so, and a handler that fails on poison rows
    queue = unique_queue(
        servicebus, "storm", requires_duplicate_detection=True, max_delivery_count=3, lock_duration="PT5S"
    )
    app = AppDir.create(
        tmp_path / "app",
        queue=queue,
        storage=azurite.connection_string,
        servicebus=servicebus.connection_string,
        batch_size=50,
        handler="handlers.crashy:handle",
        poller_toml="max_delivery_count = 3",
    )
    (app.root / "handlers" / "crashy.py").write_text(CRASHY_HANDLER)
    source = sqlite_engine(app.root / "source.db")
    with source.begin() as conn:
        conn.exec_driver_sql(SOURCE_DDL)
    target = Target(app.root / "target.db")
    host = HostProcess(app)
    rng = random.Random(17)
    try:
        # When rows arrive while the host is killed at random moments (and by the poison batch itself)
        host.start()
        kills = 0
        step = max(ROWS // (3 * KILLS), 1)
        for first in range(1, ROWS + 1, step):
            _insert(source, range(first, min(first + step, ROWS + 1)))
            if kills < KILLS and rng.random() < 0.5:
                time.sleep(rng.uniform(0.2, 2.0))  # timing chaos, not a correctness wait
                host.kill()
                kills += 1
            if not host.alive():
                host.start()
        if not host.alive():
            host.start()
        healthy = set(range(1, ROWS + 1)) - POISON

        def settled() -> bool:
            if not host.alive():  # the poison batch's redelivery killed it: restart, as Azure would
                host.start()
            stats = servicebus.queue_stats(queue)
            if stats["dead_lettered"] and any(len(rows) > 1 for rows in _dead_rows(servicebus, queue)):
                return True  # a batch was dead-lettered whole: fail now, below, showing it
            return set(target.rows()) == healthy and stats["messages"] == 0 and stats["dead_lettered"] >= 2

        wait_for(settled, 300, "every healthy row handled and the poison dead-lettered")
        # Then the DLQ holds exactly the poison rows, each alone, and every other row was handled
        dead_rows = _dead_rows(servicebus, queue)
        assert sorted(dead_rows) == sorted([i] for i in POISON), dead_rows
        assert set(target.rows()) == healthy
        # (the graceful stop needs the last host past start-up: its SIGTERM handler installed)
        wait_for(host.started, 60, "the last host to start")
        assert host.terminate() == 0, host.log_tail()
        print(f"kills={kills} starts={host.starts} rows={ROWS} dead={dead_rows}")
    finally:
        host.stop_quietly()
        target.close()
        source.dispose()


def _insert(source: sa.Engine, ids: range) -> None:
    with source.begin() as conn:
        for i in ids:
            v = "poison" if i in POISON else f"v{i}"
            conn.execute(sa.text("INSERT INTO orders (id, version, v) VALUES (:i, :i, :v)"), {"i": i, "v": v})


def _dead_rows(servicebus: Emulator, queue: str) -> list[list[int]]:
    """The row ids of each dead-lettered message."""
    with (
        ServiceBusClient.from_connection_string(servicebus.connection_string) as client,
        client.get_queue_receiver(queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq,
    ):
        dead = dlq.peek_messages(max_message_count=50)
    return [[e.pk["id"] for e in decode_batch(b"".join(m.body)).events] for m in dead]
