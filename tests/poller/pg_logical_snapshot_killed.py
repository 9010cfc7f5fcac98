"""A pg_logical snapshot tick in its own process, SIGKILLed after its N-th accepted batch of snapshot rows.

    python -m tests.poller.pg_logical_snapshot_killed CONFIG STATE_CONN CONTAINER OUT_FILE SEND_N CLOCK_OFFSET_S

Like tests/poller/pg_logical_killed_tick.py (the "queue" is OUT_FILE, fsynced before a send
returns), with two more things a snapshot test needs: each chunk's window gets writes of its own
(the rows of the chunk being read are updated and deleted between its select and its high
watermark), and the process's clock runs CLOCK_OFFSET_S ahead (past the lease of an earlier,
killed process).
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
from poller.snapshot.postgres import ChunkReader
from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.blob import open_state_store
from poller.tick.lifecycle import run_tick
from shared.config import PollerConfig
from shared.models import Batch
from shared.settings import StorageConnection
from tests.poller.pg_logical_killed_tick import FileSink


class WindowWriter(ChunkReader):
    """The real reader; after each select, before its watermark commits, it updates and deletes rows of that chunk."""

    def commit_watermark(self, conn: sa.Connection, chunk: Chunk) -> None:
        table = self._config.tables[0]
        keys = random.sample(sorted(chunk.keys), min(3, len(chunk.keys)))  # a one-column key: its values
        with self._engine.begin() as other:
            for key, statement in zip(keys, _WINDOW, strict=False):
                other.execute(sa.text(statement.format(t=table)), {"k": key})
        super().commit_watermark(conn, chunk)


class SnapshotFileSink(FileSink):
    """The file "queue", killing the process after its N-th batch holding snapshot rows: the stream's
    own pages go first, and a busy writer on a slow machine could fill N sends with them alone."""

    def __init__(self, path: str, die_after: int) -> None:
        super().__init__(path, None)
        self._snapshot_batches, self._die_after_snapshot = 0, die_after

    def send(self, batch: Batch) -> None:
        super().send(batch)
        if any(event.change == "read" for event in batch.events):
            self._snapshot_batches += 1
            if self._snapshot_batches == self._die_after_snapshot:
                os.kill(os.getpid(), signal.SIGKILL)


# What the window's writes do to three rows of the chunk being read: update, delete, update again.
_WINDOW = (
    "UPDATE {t} SET v = 'window', n = n + 1 WHERE id = :k",
    "DELETE FROM {t} WHERE id = :k",
    "UPDATE {t} SET n = n + 10 WHERE id = :k",
)


def main(argv: list[str]) -> None:
    raw: dict[str, Any] = json.loads(argv[0])
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    config = PollerConfig(**fields)
    offset = dt.timedelta(seconds=float(argv[5]))

    def clock() -> dt.datetime:
        return dt.datetime.now(dt.UTC) + offset

    store = open_state_store(StorageConnection(connection_string=argv[1]), argv[2], "t", config.name, clock=clock)
    source = PgLogicalSource(config)
    source._chunks = WindowWriter(config, source._engine)
    sink = SnapshotFileSink(argv[3], int(argv[4]))
    for _ in range(1000):  # ticks until the kill (each tick may stop early: caught up for now)
        run_tick(config, source, store, sink, owner_id=f"killed-{argv[5]}", clock=clock)
    sys.exit(3)  # the kill point was not reached


if __name__ == "__main__":
    main(sys.argv[1:])
