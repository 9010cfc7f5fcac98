"""``dbfanout run`` started after a huge transaction: its first change is the backfill, and all of
it reaches the handler (issue 33: on main every tick failed with "current transaction is aborted").

The whole pipeline: a fresh host process → the pg_logical poller → Service Bus emulator → the
example handler → a SQLite target. 40,000 rows of 500 bytes by default (enough for the cancelled
peek to abort on main every time); the issue's 200,000 rows with ``DBFANOUT_FULL_TESTS=1``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sbemulator import Emulator
from sbemulator.testing import unique_queue
from tests.conftest import FULL
from tests.host.app_support import HostProcess, Target, pg_logical_app, wait_for
from tests.poller.pg_logical_support import logical_table
from tests.support.azurite import Azurite

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROWS, WIDTH = (200_000, 1) if FULL else (40_000, 500)


@pytest.mark.timeout(1200 if FULL else 300)  # the handler writes 200,000 rows to SQLite one by one
def test_a_fresh_host_whose_first_change_is_a_huge_transaction_delivers_all_of_it(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, pg_logical_url: str
) -> None:
    with logical_table(pg_logical_url) as table:
        # Given one transaction of ROWS rows committed before the host ever ran
        table.sql(f"INSERT INTO {{t}} (id, v, n) SELECT g, repeat('x', {WIDTH}), 0 FROM generate_series(1, {ROWS}) g")
        queue = unique_queue(servicebus, "backfill", requires_duplicate_detection=True, lock_duration="PT30S")
        app = pg_logical_app(
            tmp_path / "app", queue=queue, storage=azurite.connection_string,
            servicebus=servicebus.connection_string, table=table,
            poller_toml="batch_size = 1000\nmax_batches_per_tick = 20\nlease_ttl_seconds = 30\n",
        )  # fmt: skip
        target = Target(app.root / "target.db")
        host = HostProcess(app)
        try:
            # When a fresh host runs
            host.start()
            # Then every row reaches the handler
            wait_for(lambda: target.processed() >= ROWS, 120 if not FULL else 1100, f"{ROWS} rows handled")
            assert sorted(target.rows()) == list(range(1, ROWS + 1))
            assert "current transaction is aborted" not in host.log_text()
        finally:
            host.stop_quietly()
            target.close()
