"""One racing poller process (run by test_racing_pollers): ticks N times, logs what it did.

argv: db_url azurite_conn container ticks clock_offset_seconds out_path [send_delay_seconds] [sticky]
Every accepted batch and every successful commit is appended to out_path as JSON lines. With
``sticky`` the racer keeps its lease between ticks (poller.lease.keeper.StickyLease) and releases it at the end.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import time
from dataclasses import replace

from poller.lease.keeper import StickyLease
from poller.sources.keyset.source import SqlSource
from poller.state.blob import open_state_store
from poller.tick.lifecycle import run_tick
from shared.codec import dumps
from shared.models import Batch, Checkpoint
from shared.settings import StorageConnection
from tests.poller.tick_support import make_poller


def main() -> None:
    db_url, conn, container, ticks, offset, out_path = sys.argv[1:7]
    send_delay = float(sys.argv[7]) if len(sys.argv) > 7 else 0.0
    sticky = len(sys.argv) > 8 and sys.argv[8] == "sticky"
    skew = dt.timedelta(seconds=float(offset))
    owner = f"racer-{os.getpid()}"

    def clock() -> dt.datetime:
        return dt.datetime.now(dt.UTC) + skew

    poller = replace(make_poller(db_url), lease_ttl_seconds=10, batch_size=7, max_batches_per_tick=3)
    store = open_state_store(StorageConnection(connection_string=conn), container, "race", "orders", clock=clock)
    out = open(out_path, "ab", buffering=0)  # noqa: SIM115 - kept open for the whole run

    real_commit = store.commit

    def logged_commit(snap, checkpoint: Checkpoint, ttl=None):
        new = real_commit(snap, checkpoint, ttl)
        pos = checkpoint.position
        out.write(
            dumps(
                {
                    "commit": True,
                    "owner": owner,
                    "token": new.doc.lease.fencing_token,
                    "position": None if pos is None else [pos.cursor, pos.pk["id"]],
                }
            )
            + b"\n"
        )
        return new

    store.commit = logged_commit  # type: ignore[method-assign]

    class LoggingSink:
        def send(self, batch: Batch) -> None:
            if send_delay:
                time.sleep(send_delay)  # a slow broker: keeps ticks in flight long enough to be stolen
            rows = [[e.pk["id"], e.cursor] for e in batch.events]
            out.write(dumps({"sent": rows, "owner": owner}) + b"\n")

        def close(self) -> None:
            pass

    source = SqlSource(poller)
    ttl = dt.timedelta(seconds=poller.lease_ttl_seconds)
    lease = StickyLease(store, owner, ttl, source.fingerprint, clock=clock) if sticky else None
    for _ in range(int(ticks)):
        try:
            result = run_tick(poller, source, store, LoggingSink(), owner_id=owner, clock=clock, lease=lease)
            out.write(dumps({"tick": result.stop_reason, "owner": owner}) + b"\n")
        except Exception as exc:  # a failed tick is an outcome here; the next one retries
            out.write(dumps({"error": type(exc).__name__, "owner": owner}) + b"\n")
    if lease is not None:
        lease.release()


if __name__ == "__main__":
    main()
