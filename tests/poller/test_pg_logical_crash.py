"""kind = "pg_logical" under SIGKILL: a tick process dies between enqueue and commit, or between
the landed commit and the slot advance, and nothing is lost (seed cases E/F for a slot source).

The killed tick runs as a real process (tests/poller/pg_logical_killed_tick.py) against the blob
state store on Azurite; its "queue" is a file it fsyncs before a send returns. The next ticks run
here, with a clock past the dead owner's lease. Delivered = every event of both, de-duplicated by
event id as the queue's duplicate detection does it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from poller.pg_logical import PgLogicalSource
from poller.state_blob import open_state_store
from shared.codec import decode_batch
from shared.models import Batch
from shared.settings import StorageConnection
from tests.poller.pg_logical_support import LogicalTable, events_of, logical_table, summary
from tests.poller.tick_support import RecordingSink, drain
from tests.support.azurite import Azurite

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def logical(pg_url: str) -> Iterator[LogicalTable]:
    with logical_table(pg_url) as table:
        yield table


def _write_history(table: LogicalTable) -> list[tuple[str | None, int, str | None]]:
    """Inserts, a multi-row transaction, updates and hard deletes: what must arrive, in order."""
    table.insert(range(1, 31), "a")  # one transaction of 30 rows
    for i in range(1, 6):
        table.sql(f"UPDATE {{t}} SET v = 'b{i}' WHERE id = {i}")
    table.sql("UPDATE {t} SET v = 'c' WHERE id = 1", "UPDATE {t} SET v = 'd' WHERE id = 1")
    table.sql("DELETE FROM {t} WHERE id BETWEEN 10 AND 14")
    table.insert(range(31, 41), "e")
    expected: list[tuple[str | None, int, str | None]] = [("insert", i, "a") for i in range(1, 31)]
    expected += [("update", i, f"b{i}") for i in range(1, 6)]
    expected += [("update", 1, "c"), ("update", 1, "d")]
    expected += [("delete", i, None) for i in range(10, 15)]
    expected += [("insert", i, "e") for i in range(31, 41)]
    return expected


def _run_killed_tick(table: LogicalTable, azurite: Azurite, container: str, out: Path, kill_at: str) -> None:
    config = dataclasses.asdict(table.config)
    args = [json.dumps(config), azurite.connection_string, container, str(out), kill_at]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.poller.pg_logical_killed_tick", *args],
        cwd=ROOT,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


def _file_batches(out: Path) -> list[Batch]:
    return [decode_batch(line) for line in out.read_bytes().splitlines() if line]


@pytest.mark.parametrize("kill_at", ["send:2", "acknowledge"])
def test_a_tick_killed_before_commit_or_before_the_slot_advance_loses_nothing(
    logical: LogicalTable, azurite: Azurite, tmp_path: Path, kill_at: str
) -> None:
    # Given a history of changes, pages of 7, and a tick process that is SIGKILLed
    logical.config = dataclasses.replace(logical.config, batch_size=7, max_batches_per_tick=4)
    expected = _write_history(logical)
    container, out = f"t-{uuid.uuid4().hex[:20]}", tmp_path / "queue.jsonl"
    slot_before = logical.confirmed_flush()
    _run_killed_tick(logical, azurite, container, out, kill_at)
    killed = _file_batches(out)
    # Then the slot has not moved: only an acknowledged (landed) checkpoint may advance it
    assert logical.confirmed_flush() == slot_before
    later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=logical.config.lease_ttl_seconds * 3)
    store = open_state_store(
        StorageConnection(connection_string=azurite.connection_string), container, "t", logical.config.name,
        clock=lambda: later,
    )  # fmt: skip
    snap = store.load()
    assert snap is not None
    if kill_at == "acknowledge":  # the commit landed, the advance did not happen
        assert snap.doc.checkpoint.position is not None
    # When the next ticks run (the dead owner's lease has lapsed)
    sink = RecordingSink()
    drain(logical.config, PgLogicalSource(logical.config), store, sink, owner_id="next", clock=lambda: later)
    # Then every change arrived, in commit order, once after de-duplication
    assert summary(events_of([*killed, *sink.accepted])) == expected
    if kill_at == "acknowledge":
        # and nothing at or before the landed checkpoint was sent again (the slot was behind it)
        resent = {e.event_id for b in sink.accepted for e in b.events}
        assert not {e.event_id for b in killed for e in b.events} & resent
    assert logical.confirmed_flush() > slot_before
