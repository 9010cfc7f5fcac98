"""A mysql_binlog snapshot under concurrent writes and SIGKILLs (MariaDB, the blob state on Azurite).

Each killed tick runs as a real process (tests/poller/mysql_binlog_snapshot_killed.py) whose chunk
windows get writes of their own; a writer in this process updates, deletes and re-inserts rows
throughout. Every write sets a per-key version (tests/poller/mysql_binlog_support.Versions), so
the DBLog guarantee is checked directly: in delivery order no snapshot row is older than a change
of its key delivered before it, none resurrects a deleted key, and the target rebuilt from
everything delivered (duplicates dropped) equals the source. Small counts by default;
DBFANOUT_FULL_TESTS=1 snapshots more rows.
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
from typing import Any

import pytest
import sqlalchemy as sa

from poller.snapshot.mysql import mysql_signal_sql, quote_mysql, signal_table
from poller.sources.mysql_binlog.source import MysqlBinlogSource
from poller.state.blob import open_state_store
from shared.codec import decode_batch
from shared.config import PollerConfig
from shared.models import Batch, SnapshotState
from shared.settings import StorageConnection
from tests.conftest import FULL
from tests.poller.mysql_binlog_support import BinlogTables, Versions, binlog_tables, events_of, stale_or_resurrected
from tests.poller.tick_support import RecordingSink, drain
from tests.support.azurite import Azurite
from tests.support.databases import unique_name

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def tables(mysql_binlog_url: str) -> Iterator[BinlogTables]:
    with binlog_tables(mysql_binlog_url) as made:
        made.config = dataclasses.replace(
            made.config,
            name=unique_name("p"),
            tables=(made.qualified,),
            table=made.qualified,
            signal_table=f"{made.database}.{made.name}_sig",
        )
        versions = Versions(made.name)
        versions.create(made.engine)
        with made.engine.begin() as conn:
            for statement in mysql_signal_sql(made.config):
                conn.execute(sa.text(statement))
        try:
            yield made
        finally:
            versions.drop(made.engine)
            with made.engine.begin() as conn:
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {quote_mysql(signal_table(made.config))}"))


class _Writer(threading.Thread):
    """Updates, deletes and re-inserts random rows while the snapshot runs (one transaction each)."""

    def __init__(self, tables: BinlogTables, keys: int) -> None:
        super().__init__(daemon=True)
        self.tables, self.keys, self.stop, self.writes = tables, keys, threading.Event(), 0
        self.versions, self.rng = Versions(tables.name), random.Random(30)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.wait(0.002):  # a pace, not a wait for a condition
                with self.tables.engine.begin() as conn:
                    op = self.rng.choice(("update", "update", "delete", "upsert"))
                    self.versions.write(conn, self.rng.randrange(self.keys), op, "writer")
                self.writes += 1
        except BaseException as exc:  # the test fails on it
            self.error = exc


def _killed(config: PollerConfig, azurite: Azurite, container: str, out: Path, send: int, offset: float) -> None:
    args = [json.dumps(dataclasses.asdict(config)), azurite.connection_string, container, str(out), str(send)]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.poller.mysql_binlog_snapshot_killed", *args, str(offset)],
        cwd=ROOT,
        capture_output=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


def _state(store: Any) -> SnapshotState | None:
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    state: SnapshotState | None = snap.doc.checkpoint.position.snapshot
    return state


def test_a_snapshot_under_concurrent_writes_and_two_kills_is_never_stale_and_rebuilds_the_source(
    tables: BinlogTables, azurite: Azurite, tmp_path: Path
) -> None:
    # Given rows that exist before the poller's first tick (20k with DBFANOUT_FULL_TESTS=1), snapshot = "initial"
    rows, chunk = (20_000, 500) if FULL else (2000, 100)
    with tables.engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {tables.name} (id, v, n) VALUES (:id, 'old', 0)"),
                     [{"id": i} for i in range(rows)])  # fmt: skip
    config = dataclasses.replace(
        tables.config,
        snapshot="initial",
        snapshot_chunk_size=chunk,
        batch_size=chunk,
        max_batches_per_tick=10,
        max_uncommitted_batches=2,  # commits land while the next pages are sent: the kills find some landed
    )
    container = f"t-{uuid.uuid4().hex[:20]}"
    writer = _Writer(tables, rows + 50)
    writer.start()
    done: SnapshotState | None = None
    try:
        # When a writer updates, deletes and re-inserts rows throughout, each chunk's own rows are
        # changed inside its window, and the tick process is SIGKILLed twice mid-snapshot
        ttl = config.lease_ttl_seconds
        outs = [tmp_path / "first.jsonl", tmp_path / "second.jsonl"]
        _killed(config, azurite, container, outs[0], send=4, offset=0)
        _killed(config, azurite, container, outs[1], send=9, offset=3 * ttl)
        killed: list[Batch] = [decode_batch(line) for out in outs for line in out.read_bytes().splitlines() if line]
        later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=6 * ttl)
        store = open_state_store(
            StorageConnection(connection_string=azurite.connection_string), container, "t", config.name,
            clock=lambda: later,
        )  # fmt: skip
        mid = _state(store)
        assert mid is not None and mid.active and mid.rows > 0  # killed mid-snapshot, resumed after
        sink, source = RecordingSink(), MysqlBinlogSource(config)
        for _ in range(200):  # the rest of the snapshot, with the writer still writing
            drain(config, source, store, sink, owner_id="next", clock=lambda: later)
            done = _state(store)
            if done is not None and not done.active:
                break
    finally:
        writer.stop.set()
        writer.join()
    assert writer.error is None, writer.error
    drain(config, source, store, sink, owner_id="next", clock=lambda: later)  # what the writer did last
    source.close()
    # Then the snapshot finished, no snapshot row was older than a change of its key delivered
    # before it (none resurrected a deleted key), and the target equals the source
    events = events_of([*killed, *sink.accepted])
    assert writer.writes > 0 and done is not None and not done.active and done.error is None
    assert done.rows >= rows // 2
    assert stale_or_resurrected(events) == []
    target: dict[int, tuple[object, object]] = {}
    for e in events:
        if e.change == "delete":
            target.pop(e.pk["id"], None)
        else:
            assert e.after is not None
            target[e.pk["id"]] = (e.after["v"], e.after["n"])
    with tables.engine.connect() as conn:
        source_rows = {r.id: (r.v, r.n) for r in conn.execute(sa.text(f"SELECT id, v, n FROM {tables.name}"))}
    assert target == source_rows
