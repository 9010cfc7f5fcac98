"""A pg_logical tick in its own process that SIGKILLs itself at a chosen point (crash tests).

    python -m tests.poller.pg_logical_killed_tick CONFIG_JSON STATE_CONNECTION CONTAINER OUT_FILE KILL_AT [MAX_DECODED]

KILL_AT is ``send:N`` (die right after the N-th batch was accepted, before its commit) or
``acknowledge`` (die after the tick's last checkpoint write landed, before the slot advances).
The "queue" is OUT_FILE: each accepted batch is one JSON line, flushed and fsynced before the
sink returns, so what the file holds is what a broker would have accepted. MAX_DECODED lowers the
source's in-memory cap (a small transaction is then "huge": spooled, see poller.sources.pg_logical.spool).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.blob import open_state_store
from poller.tick.lifecycle import run_tick
from shared.codec import encode_batch
from shared.config import PollerConfig
from shared.models import Batch, Checkpoint
from shared.settings import StorageConnection


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class FileSink:
    def __init__(self, path: str, die_after: int | None) -> None:
        self._file = open(path, "ab")  # noqa: SIM115 - closed by the process ending
        self._sent = 0
        self._die_after = die_after

    def send(self, batch: Batch) -> None:
        self._file.write(encode_batch(batch) + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._sent += 1
        if self._sent == self._die_after:
            _die()

    def close(self) -> None:
        self._file.close()


class DyingSource(PgLogicalSource):
    def acknowledge(self, checkpoint: Checkpoint) -> None:
        _die()


def main(argv: list[str]) -> None:
    raw: dict[str, Any] = json.loads(argv[0])
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    config = PollerConfig(**fields)
    store = open_state_store(StorageConnection(connection_string=argv[1]), argv[2], "t", config.name)
    kill_at = argv[4]
    die_after = int(kill_at.split(":")[1]) if kill_at.startswith("send:") else None
    source = DyingSource(config) if kill_at == "acknowledge" else PgLogicalSource(config)
    if len(argv) > 5:
        source.MAX_DECODED = int(argv[5])
    run_tick(config, source, store, FileSink(argv[3], die_after), owner_id="killed")
    sys.exit(3)  # the kill point was not reached


if __name__ == "__main__":
    main(sys.argv[1:])
