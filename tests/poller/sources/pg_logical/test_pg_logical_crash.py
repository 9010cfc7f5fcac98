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
import random
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.blob import open_state_store
from shared.codec import decode_batch
from shared.config import PollerConfig
from shared.models import Batch
from shared.settings import StorageConnection
from tests.conftest import FULL
from tests.poller.pg_logical_support import LogicalTable, events_of, logical_table, summary
from tests.poller.tick_support import RecordingSink, drain
from tests.support.azurite import Azurite

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture
def logical(pg_logical_url: str) -> Iterator[LogicalTable]:
    with logical_table(pg_logical_url) as table:
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


def _snapshot_killed(
    config: PollerConfig, azurite: Azurite, container: str, out: Path, send: int, offset: float
) -> None:
    args = [json.dumps(dataclasses.asdict(config)), azurite.connection_string, container, str(out), str(send)]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.poller.pg_logical_snapshot_killed", *args, str(offset)],
        cwd=ROOT,
        capture_output=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


class _Writer(threading.Thread):
    """Updates, deletes and re-inserts random rows while the snapshot runs (one transaction each)."""

    def __init__(self, table: LogicalTable, keys: int) -> None:
        super().__init__(daemon=True)
        self.table, self.keys, self.stop, self.writes = table, keys, threading.Event(), 0
        self.rng = random.Random(25)

    def run(self) -> None:
        while not self.stop.wait(0.002):  # a pace, not a wait for a condition
            key = self.rng.randrange(self.keys)
            statement = self.rng.choice(
                [
                    "UPDATE {t} SET v = 'writer', n = n + 1 WHERE id = :k",
                    "DELETE FROM {t} WHERE id = :k",
                    "INSERT INTO {t} (id, v, n) VALUES (:k, 'back', 0) ON CONFLICT (id) DO NOTHING",
                ]
            )
            self.table.sql(statement, params={"k": key})
            self.writes += 1


def test_a_snapshot_under_concurrent_writes_and_two_kills_rebuilds_the_source(
    logical: LogicalTable, azurite: Azurite, tmp_path: Path
) -> None:
    # Given rows that predate the slot (100k with DBFANOUT_FULL_TESTS=1), snapshot = "initial"
    rows, chunk = (100_000, 1000) if FULL else (3000, 100)
    logical.drop_slot()
    with logical.engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {logical.name} (id, v, n) SELECT g, 'old', 0 FROM generate_series(0, :n) g"),
                     {"n": rows - 1})  # fmt: skip
    logical.create_slot()
    config = dataclasses.replace(
        logical.config,
        snapshot="initial",
        snapshot_chunk_size=chunk,
        batch_size=chunk,
        max_batches_per_tick=10,
        max_uncommitted_batches=2,  # commits land while the next pages are sent: the kills find some landed
    )
    container = f"t-{uuid.uuid4().hex[:20]}"
    writer = _Writer(logical, rows + 50)
    writer.start()
    try:
        # When a writer updates, deletes and re-inserts rows throughout, each chunk's own rows are
        # changed inside its window, and the tick process is SIGKILLed twice mid-snapshot
        ttl = config.lease_ttl_seconds
        outs = [tmp_path / "first.jsonl", tmp_path / "second.jsonl"]
        _snapshot_killed(config, azurite, container, outs[0], send=5, offset=0)
        _snapshot_killed(config, azurite, container, outs[1], send=12, offset=3 * ttl)
        killed = [b for out in outs for b in _file_batches(out)]
        later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=6 * ttl)
        store = open_state_store(
            StorageConnection(connection_string=azurite.connection_string), container, "t", config.name,
            clock=lambda: later,
        )  # fmt: skip
        mid = store.load()
        assert mid is not None and mid.doc.checkpoint.position is not None
        state = mid.doc.checkpoint.position.snapshot
        assert state is not None and state.active and state.rows > 0  # killed mid-snapshot, resumed after
        sink = RecordingSink()
        source = PgLogicalSource(config)
        for _ in range(200):  # the rest of the snapshot, with the writer still writing
            drain(config, source, store, sink, owner_id="next", clock=lambda: later)
            snap = store.load()
            assert snap is not None and snap.doc.checkpoint.position is not None
            done = snap.doc.checkpoint.position.snapshot
            if done is not None and not done.active:
                break
    finally:
        writer.stop.set()
        writer.join()
    drain(config, source, store, sink, owner_id="next", clock=lambda: later)  # what the writer did last
    # Then the target rebuilt from everything delivered (duplicates dropped) equals the source
    events = events_of([*killed, *sink.accepted])
    target: dict[int, tuple[object, object]] = {}
    for e in events:
        if e.op == "delete":
            target.pop(e.pk["id"], None)
        else:
            assert e.after is not None
            target[e.pk["id"]] = (e.after["v"], e.after["n"])
    with logical.engine.connect() as conn:
        source_rows = {r.id: (r.v, r.n) for r in conn.execute(sa.text(f"SELECT id, v, n FROM {logical.name}"))}
    assert writer.writes > 0 and done is not None and done.rows >= rows // 2
    assert target == source_rows
