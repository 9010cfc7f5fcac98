"""A mysql_binlog snapshot tick in its own process, SIGKILLed after its N-th accepted batch of snapshot rows.

    python -m tests.poller.mysql_binlog_snapshot_killed CONFIG STATE_CONN CONTAINER OUT_FILE SEND_N CLOCK_OFFSET_S

Like tests/poller/pg_logical_snapshot_killed.py, over the binlog: the "queue" is OUT_FILE (fsynced
before a send returns); each chunk's window gets writes of its own (three rows of the chunk being
read are updated, deleted and re-inserted between its select and its high watermark, with
:class:`~tests.poller.mysql_binlog_support.Versions`); the clock runs CLOCK_OFFSET_S ahead (past
the lease of an earlier, killed process).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import signal
import sys
from typing import Any

import sqlalchemy as sa

from poller.snapshot.chunks import Chunk
from poller.snapshot.mysql import MysqlChunkReader
from poller.sources.mysql_binlog.source import MysqlBinlogSource
from poller.state.blob import open_state_store
from poller.tick.lifecycle import run_tick
from shared.config import PollerConfig
from shared.models import Batch
from shared.settings import StorageConnection
from tests.poller.mysql_binlog_killed_tick import FileSink
from tests.poller.mysql_binlog_support import Versions


class WindowWriter(MysqlChunkReader):
    """The real reader; after each select, before its watermark commits, it writes rows of that chunk."""

    versions: Versions

    def commit_watermark(self, conn: sa.Connection, chunk: Chunk) -> None:
        keys = random.sample(sorted(chunk.keys), min(3, len(chunk.keys)))  # a one-column key: its values
        with self._engine.begin() as other:
            for key, op in zip(keys, ("update", "delete", "upsert"), strict=False):
                self.versions.write(other, key, op, "window")
        super().commit_watermark(conn, chunk)


class SnapshotFileSink(FileSink):
    """The file "queue", killing the process after its N-th batch holding snapshot rows."""

    def __init__(self, path: str, die_after: int) -> None:
        super().__init__(path, 0)
        self._snapshot_batches, self._die_after_snapshot = 0, die_after

    def send(self, batch: Batch) -> None:
        super().send(batch)
        if any(event.change == "read" for event in batch.events):
            self._snapshot_batches += 1
            if self._snapshot_batches == self._die_after_snapshot:
                os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    raw: dict[str, Any] = json.loads(argv[0])
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    config = PollerConfig(**fields)
    offset = dt.timedelta(seconds=float(argv[5]))

    def clock() -> dt.datetime:
        return dt.datetime.now(dt.UTC) + offset

    store = open_state_store(StorageConnection(connection_string=argv[1]), argv[2], "t", config.name, clock=clock)
    source = MysqlBinlogSource(config)
    writer = WindowWriter(config, source._engine)
    writer.versions = Versions(config.tables[0].rpartition(".")[2])
    source._snapshots.chunks = writer
    sink = SnapshotFileSink(argv[3], int(argv[4]))
    for _ in range(1000):  # ticks until the kill (each tick may stop early: caught up for now)
        run_tick(config, source, store, sink, owner_id=f"killed-{argv[5]}", clock=clock)
    sys.exit(3)  # the kill point was not reached


if __name__ == "__main__":
    main(sys.argv[1:])
