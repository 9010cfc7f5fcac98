"""One outbox poller process that dies by SIGKILL (run by test_outbox_crash): never commits page N.

argv: db_url table azurite_conn container out_path block_on_send
Every batch the sink accepts is appended to out_path (its id and event ids, one JSON line);
the send numbered ``block_on_send`` is recorded and then blocks until the parent kills us.
"""

from __future__ import annotations

import sys
import threading

from poller.sources.factory import open_source
from poller.state.blob import open_state_store
from poller.tick.lifecycle import run_tick
from shared.codec import dumps
from shared.models import Batch
from shared.settings import StorageConnection
from tests.poller.outbox_support import outbox_poller


def main() -> None:
    db_url, table, conn, container, out_path, block_on = sys.argv[1:7]
    poller = outbox_poller(db_url, table, batch_size=5, max_batches_per_tick=10, outbox_retention_seconds=0)
    store = open_state_store(StorageConnection(connection_string=conn), container, "crash", poller.name)
    out = open(out_path, "ab", buffering=0)  # noqa: SIM115 - kept open until we are killed
    sends = 0

    class BlockingSink:
        def send(self, batch: Batch) -> None:
            nonlocal sends
            sends += 1
            out.write(dumps({"batch_id": batch.batch_id, "events": [e.event_id for e in batch.events]}) + b"\n")
            if sends == int(block_on):
                threading.Event().wait()  # accepted by the broker; the commit never comes: SIGKILL lands here

        def close(self) -> None:
            pass

    run_tick(poller, open_source(poller), store, BlockingSink(), owner_id="doomed")


if __name__ == "__main__":
    main()
