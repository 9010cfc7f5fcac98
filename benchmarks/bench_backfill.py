"""A one-transaction backfill through a pg_logical poller (issue 33). Run by hand; prints one table row.

    .venv/bin/python benchmarks/bench_backfill.py --rows 200000
    .venv/bin/python benchmarks/bench_backfill.py --rows 1000000 [--code DIR]   # DIR: another tree's code

A table of --rows rows is filled before its slot exists; then ONE transaction updates every row
(``UPDATE t SET n = n + 1``: a backfill) and the poller drains it: run_tick() until every row
arrived (batch_size 1000, max_batches_per_tick 20, as the issue measured), with a sink that
builds every event and an in-memory state store (the broker and the blob store are not what is
measured). One run per process: the peak RSS is this run's.

Printed: events/s (the commit is done before the clock starts), when the first page was sent,
the PostgreSQL CPU of the poller's own backends (utime + stime from /proc, sampled: the server is
shared, so not the whole server's), the slot's decoding statistics (``pg_stat_replication_slots``:
transactions and bytes decoded, bytes spilled to disk and streamed; the transactions include
other sessions' in the same database), the host's peak RSS and the WAL the slot retained at most
while the transaction drained. ``--code DIR`` puts DIR first on sys.path (e.g.
an export of main's poller/ and shared/ for the before figure).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
if "--code" in sys.argv:
    sys.path.insert(0, sys.argv[sys.argv.index("--code") + 1])

import sqlalchemy as sa  # noqa: E402

from poller.sources.pg_logical.source import PgLogicalSource  # noqa: E402
from poller.state.memory import MemoryStateStore  # noqa: E402
from poller.tick.lifecycle import run_tick  # noqa: E402
from shared.models import Batch  # noqa: E402
from tests.poller.pg_logical_support import LogicalTable, logical_reason  # noqa: E402
from tests.support.databases import PG_URL, unreachable_reason  # noqa: E402

_TICKS = os.sysconf("SC_CLK_TCK")


class CountingSink:
    """Builds every event (as an encoding sink would) and marks each row's id once."""

    def __init__(self, rows: int) -> None:
        self.seen = bytearray(rows + 1)
        self.distinct = 0
        self.events = 0
        self.first: float | None = None  # perf_counter at the first batch

    def send(self, batch: Batch) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        for event in batch.events:
            self.events += 1
            i = int(event.pk["id"])
            if not self.seen[i]:
                self.seen[i] = 1
                self.distinct += 1

    def close(self) -> None:
        pass


class Sampler(threading.Thread):
    """Every 0.2 s: the CPU of the backends named ``app`` and the WAL the slot retains."""

    def __init__(self, engine: sa.Engine, app: str, slot: str) -> None:
        super().__init__(daemon=True)
        self.engine, self.app, self.slot = engine, app, slot
        self.cpu: dict[int, float] = {}
        self.retained = 0
        self.stop = threading.Event()

    def sample(self, conn: sa.Connection) -> None:
        pids = conn.execute(sa.text("SELECT pid FROM pg_stat_activity WHERE application_name = :a"), {"a": self.app})
        for (pid,) in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            self.cpu[pid] = (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
        retained = conn.execute(
            sa.text(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn) FROM pg_replication_slots"
                " WHERE slot_name = :s"
            ),
            {"s": self.slot},
        ).scalar()
        self.retained = max(self.retained, int(retained or 0))
        conn.rollback()

    def run(self) -> None:
        with self.engine.connect() as conn:
            while not self.stop.wait(0.2):
                self.sample(conn)
            self.sample(conn)


def slot_stats(engine: sa.Engine, slot: str) -> dict[str, Any]:
    with engine.connect() as conn:
        row = (
            conn.execute(
                sa.text(
                    "SELECT total_txns, total_bytes, spill_txns, spill_bytes, stream_bytes"
                    " FROM pg_stat_replication_slots WHERE slot_name = :s"
                ),
                {"s": slot},
            )
            .mappings()
            .first()
        )
    return dict(row) if row else {}


def run(rows: int) -> dict[str, Any]:
    table = LogicalTable(PG_URL)
    app = f"bench-backfill-{uuid.uuid4().hex[:8]}"
    try:
        table.create(slot=False)
        with table.engine.begin() as conn:  # the rows predate the slot: only the backfill is in it
            conn.execute(sa.text(f"INSERT INTO {table.name} (id, v, n) SELECT g, 'customer-' || g, 0"
                                 " FROM generate_series(1, :n) g"), {"n": rows})  # fmt: skip
        table.create_slot()
        with table.engine.begin() as conn:  # the backfill: one transaction
            conn.execute(sa.text(f"UPDATE {table.name} SET n = n + 1"))
        sep = "&" if "?" in PG_URL else "?"
        config = replace(table.config, source_url=f"{PG_URL}{sep}application_name={app}", batch_size=1000,
                         max_batches_per_tick=20, lease_ttl_seconds=600)  # fmt: skip
        slot = table.config.slot
        assert slot is not None
        before = slot_stats(table.engine, slot)
        source, store, sink = PgLogicalSource(config), MemoryStateStore(config.name), CountingSink(rows)
        sampler = Sampler(table.engine, app, slot)
        sampler.start()
        ticks = 0
        started = time.perf_counter()
        while sink.distinct < rows:
            run_tick(config, source, store, sink, owner_id="bench")
            ticks += 1
        seconds = time.perf_counter() - started
        sampler.stop.set()
        sampler.join()
        source.close()
        after = slot_stats(table.engine, slot)
        delta = {k: int(after.get(k) or 0) - int(before.get(k) or 0) for k in after}
        return {
            "rows": rows,
            "seconds": seconds,
            "first_s": (sink.first or started) - started,
            "events/s": rows / seconds,
            "ticks": ticks,
            "events": sink.events,
            "server_cpu_s": sum(sampler.cpu.values()),
            "decoded_txns": delta.get("total_txns"),
            "decoded_mib": delta.get("total_bytes", 0) / 2**20,
            "spilled_mib": delta.get("spill_bytes", 0) / 2**20,
            "streamed_mib": delta.get("stream_bytes", 0) / 2**20,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "retained_wal_mib": sampler.retained / 2**20,
        }
    finally:
        table.drop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--code", help="a directory put first on sys.path (another tree's poller/ and shared/)")
    args = parser.parse_args()
    reason = unreachable_reason(PG_URL) or logical_reason(PG_URL)
    if reason:
        sys.exit(f"cannot run: {reason}")
    r = run(args.rows)
    load = Path("/proc/loadavg").read_text().split()[:3]
    head = ["rows", "events/s", "seconds", "first page s", "server CPU s", "decoded txns", "decoded MiB",
            "spilled MiB", "streamed MiB", "peak RSS MiB", "retained WAL MiB", "load"]  # fmt: skip
    cells = [f"{r['rows']:,}", f"{r['events/s']:,.0f}", f"{r['seconds']:.1f}", f"{r['first_s']:.1f}",
             f"{r['server_cpu_s']:.1f}", str(r["decoded_txns"]), f"{r['decoded_mib']:,.0f}",
             f"{r['spilled_mib']:,.0f}", f"{r['streamed_mib']:,.0f}", f"{r['peak_rss_mib']:.0f}",
             f"{r['retained_wal_mib']:,.0f}", " ".join(load)]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join(cells) + " |")
    print(f"events sent {r['events']:,} (distinct {r['rows']:,}), ticks {r['ticks']}")


if __name__ == "__main__":
    main()
