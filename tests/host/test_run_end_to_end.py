"""``dbfanout run`` end to end: the real function_app.py and example handler, in a subprocess.

SQLite source written concurrently (inserts, updates, soft deletes) → poller timer → emulator
queue (duplicate detection, MaxDeliveryCount 10, lock PT30S) → queue trigger → example handler
→ SQLite target. The target must equal the live source rows exactly.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from azure.core.exceptions import ResourceNotFoundError
from azure.storage.blob import BlobServiceClient

from sbemulator import Emulator
from sbemulator.testing import unique_queue
from shared.codec import loads
from tests.conftest import FULL
from tests.host.app_support import (
    AppDir,
    HostProcess,
    SourceWriter,
    Target,
    drop_pg_schema,
    pg_schema_url,
    wait_for,
)
from tests.support.azurite import Azurite
from tests.support.databases import PG_URL, unique_name, unreachable_reason

pytestmark = pytest.mark.integration

ROWS = 20_000 if FULL else 2_000
CRASH_ROWS = 5_000 if FULL else 600
KILLS = 30 if FULL else 6


def _app(tmp_path: Path, azurite: Azurite, servicebus: Emulator, db_url: str | None = None) -> AppDir:
    queue = unique_queue(
        servicebus, "orders", requires_duplicate_detection=True, max_delivery_count=10, lock_duration="PT30S"
    )
    return AppDir.create(
        tmp_path / "app",
        queue=queue,
        storage=azurite.connection_string,
        servicebus=servicebus.connection_string,
        source_url=db_url,
        target_url=db_url,
    )


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """None: SQLite files in the app folder; else a PostgreSQL schema of its own."""
    if request.param == "sqlite":
        yield None
        return
    reason = unreachable_reason(PG_URL)
    if reason:
        pytest.skip(reason)
    schema = unique_name("e2e")
    url = pg_schema_url(PG_URL, schema)
    try:
        yield url
    finally:
        drop_pg_schema(PG_URL, schema)


def _converged(writer: SourceWriter, target: Target) -> bool:
    return writer.done and target.rows() == writer.expected()


def test_run_replicates_concurrent_inserts_updates_and_soft_deletes_exactly(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, db_url: str | None
) -> None:
    # Given the app folder, its source table and a running host
    app = _app(tmp_path, azurite, servicebus, db_url)
    writer = SourceWriter(db_url or app.root / "source.db", ROWS, pause=0.02)
    target = Target(db_url or app.root / "target.db")
    host = HostProcess(app).start()
    try:
        # When a writer inserts, updates and soft-deletes rows while the app runs
        writer.start()
        writer.join(600)
        wait_for(lambda: _converged(writer, target), 120 + ROWS / 100, "the target to match the source")
        # Then the target equals the live source rows, each event recorded once
        expected = writer.expected()
        assert target.rows() == expected
        assert writer.ops["update"] > 0 and writer.ops["delete"] > 0
        assert target.processed() >= len(expected)
        # And Ctrl-C/SIGTERM stops the host cleanly
        assert host.terminate() == 0, host.log_tail()
        assert "host stopped" in host.log_tail()
        wait_for(lambda: servicebus.queue_stats(app.queue)["messages"] == 0, 30, "the queue to be empty")

        # When the checkpoint is lost and the poller re-sends every row (new batches, same event ids)
        blobs = BlobServiceClient.from_connection_string(azurite.connection_string)
        blobs.get_blob_client("db-state", f"state/{app.app_name}/orders.json").delete_blob()
        processed_before = target.processed()
        host.start()
        # Then the processed-events table absorbs every re-sent event as a duplicate
        total = writer.total_rows()
        wait_for(lambda: target.duplicates() >= total, 120, "every re-sent event to be absorbed")
        assert target.processed() == processed_before
        assert target.rows() == expected
        assert host.terminate() == 0
        stats = servicebus.queue_stats(app.queue)
        assert stats["dead_lettered"] == 0 and stats["messages"] == 0
    finally:
        host.stop_quietly()
        target.close()


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_nothing(tmp_path: Path, azurite: Azurite, servicebus: Emulator) -> None:
    # Given a writer spread over the whole kill phase
    app = _app(tmp_path, azurite, servicebus)
    writer = SourceWriter(app.root / "source.db", CRASH_ROWS, per_txn=5, pause=0.1)
    target = Target(app.root / "target.db")
    host = HostProcess(app)
    rng = random.Random(2024)
    try:
        writer.start()
        # When the host is SIGKILLed at random moments (during start-up, ticks, handlers) and restarted
        for _ in range(KILLS):
            host.start()
            if rng.random() < 0.8:  # most kills land while it works; some during start-up
                wait_for(host.started, 60, "the host to start")
            _sleep_random(rng)
            host.kill()
        host.start()
        # The graceful stop below needs the last host past start-up (its SIGTERM handler installed):
        # the rows may all be handled already, so convergence alone does not wait for it
        wait_for(host.started, 60, "the last host to start")
        writer.join(300)
        # Then, once locks and leases of the dead hosts expire, the target matches the source exactly
        wait_for(lambda: _converged(writer, target), 180, "the target to match the source after the kills")
        assert host.starts == KILLS + 1
        assert target.rows() == writer.expected()
        assert target.processed() >= len(writer.expected())
        stats = servicebus.queue_stats(app.queue)
        assert stats["dead_lettered"] == 0
        assert host.terminate() == 0, host.log_tail()
        print(f"kills={KILLS} rows={CRASH_ROWS} processed={target.processed()} duplicates={target.duplicates()}")
    finally:
        host.stop_quietly()
        target.close()


def _processed_at_least(target: Target, n: int) -> bool:
    return target.processed() >= n


def _sleep_random(rng: random.Random) -> None:
    """Let the host run a random while before the kill (timing chaos, not a correctness wait)."""
    time.sleep(rng.uniform(0.1, 3.0))


@pytest.mark.slow
def test_two_hosts_on_one_app_keep_one_owner_and_hand_over_after_sigkill_and_sigterm(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator
) -> None:
    # Given one app run by two `dbfanout run` processes (lease_ttl_seconds = 10, a 1 s schedule)
    app = _app(tmp_path, azurite, servicebus)
    blob = BlobServiceClient.from_connection_string(azurite.connection_string).get_blob_client(
        "db-state", f"state/{app.app_name}/orders.json"
    )

    def owner() -> str | None:
        try:
            return loads(blob.download_blob().readall())["lease"]["owner_id"]  # type: ignore[no-any-return]
        except ResourceNotFoundError:
            return None

    def owned_by(host: HostProcess) -> bool:
        assert host.proc is not None
        return f"/{host.proc.pid}/" in (owner() or "")

    writer = SourceWriter(app.root / "source.db", 600, per_txn=5, pause=0.1)
    target = Target(app.root / "target.db")
    a, b = HostProcess(app), HostProcess(app)
    try:
        writer.start()
        a.start()
        wait_for(lambda: owned_by(a), 60, "the first host to hold the lease")
        b.start()
        wait_for(b.started, 60, "the second host to start")
        # Then while both run and rows keep flowing, the first keeps the lease
        for more in (20, 40, 60):
            wait_for(partial(_processed_at_least, target, more), 60, "more rows to be delivered")
            assert owned_by(a), owner()
        # When the owner is SIGKILLed, Then the other takes over within TTL + skew margin + one interval
        a.kill()
        killed = time.monotonic()
        wait_for(lambda: owned_by(b), 10 + 5 + 1 + 5, "the second host to take the lease over")
        took = time.monotonic() - killed
        # When a new first host runs and the owner stops gracefully (SIGTERM: it releases its lease)
        a.start()
        wait_for(a.started, 60, "the restarted host to start")
        assert owned_by(b)
        assert b.terminate() == 0, b.log_tail()
        stopped = time.monotonic()
        # Then the waiting host takes over within one interval (plus a tick's start)
        wait_for(lambda: owned_by(a), 1 + 2, "the restarted host to take the released lease")
        handed = time.monotonic() - stopped
        # And no row was lost: the target matches the source
        writer.join(300)
        wait_for(lambda: _converged(writer, target), 120, "the target to match the source")
        assert target.rows() == writer.expected()
        assert a.terminate() == 0, a.log_tail()
        print(f"handover after SIGKILL {took:.1f}s, after SIGTERM {handed:.1f}s")
    finally:
        for host in (a, b):
            host.stop_quietly()
        target.close()
