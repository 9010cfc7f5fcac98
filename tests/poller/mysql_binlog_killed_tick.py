"""A mysql_binlog tick in its own process that SIGKILLs itself after its N-th accepted batch (crash tests).

    python -m tests.poller.mysql_binlog_killed_tick CONFIG_JSON STATE_CONNECTION CONTAINER OUT_FILE SEND CLOCK_OFFSET

The "queue" is OUT_FILE: each accepted batch is one JSON line, fsynced before the sink returns, so
what the file holds is what a broker would have accepted. CLOCK_OFFSET (seconds) moves this
process's clock past the lease a previous killed process left behind.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import sys
from typing import Any

from poller.sources.mysql_binlog.source import MysqlBinlogSource
from poller.state.blob import open_state_store
from poller.tick.lifecycle import run_tick
from shared.codec import encode_batch
from shared.config import PollerConfig
from shared.models import Batch
from shared.settings import StorageConnection


class FileSink:
    def __init__(self, path: str, die_after: int) -> None:
        self._file = open(path, "ab")  # noqa: SIM115 - closed by the process ending
        self._sent, self._die_after = 0, die_after

    def send(self, batch: Batch) -> None:
        self._file.write(encode_batch(batch) + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._sent += 1
        if self._sent == self._die_after:
            os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        self._file.close()


def main(argv: list[str]) -> None:
    raw: dict[str, Any] = json.loads(argv[0])
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    config = PollerConfig(**fields)
    offset = dt.timedelta(seconds=float(argv[5]))

    def clock() -> dt.datetime:
        return dt.datetime.now(dt.UTC) + offset

    store = open_state_store(StorageConnection(connection_string=argv[1]), argv[2], "t", config.name, clock=clock)
    sink = FileSink(argv[3], int(argv[4]))
    source = MysqlBinlogSource(config)
    for _ in range(50):  # ticks until the kill (a tick may end caught up before its N-th batch)
        run_tick(config, source, store, sink, owner_id="killed", clock=clock)
    sys.exit(3)  # the kill point was not reached


if __name__ == "__main__":
    main(sys.argv[1:])
