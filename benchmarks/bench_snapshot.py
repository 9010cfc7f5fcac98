"""pg_logical snapshot throughput beside keyset catch-up of the same table (issue 25). Run by hand.

    .venv/bin/python benchmarks/bench_snapshot.py                   # 100k rows, batches of 1000
    .venv/bin/python benchmarks/bench_snapshot.py --rows 1000000    # the issue's 1M-row figure

One table (``id INTEGER PRIMARY KEY, v TEXT, n INTEGER``), filled before its slot exists, then in
the same run:

keyset     : a keyset poller (cursor id) on the table, run_tick() until caught up: the rate a
             cloned backfill poller reads it at (the issue's yardstick)
snapshot   : a pg_logical poller with snapshot = "initial", run_tick() until its snapshot finished
             (chunk select + high watermark → peek to it → emit, a page at a time), no concurrent
             writes; chunks of --chunk rows (0: the default, snapshot_chunk_size unset)
latency    : the live stream's commit → sink latency (a writer process inserts a row every 20 ms),
             idle (the stream alone) and during snapshots (run back to back for as long), median
             and p95. Measured from the transaction's commit time as the log carries it (the
             event's committed_at); "from the insert" also counts the writer's statement

The heap built by the imports is frozen out of the cyclic GC (``gc.freeze()``), as
function_app.py does at startup for ``dbfanout run`` and the Functions host. Both sinks build every
event (ids, envelope fields). State in memory; max_batches_per_tick 20
(the default) for both. Rows per second, the best of
--repeat rounds, and the process RSS before and after each phase (flat = the snapshot does not
hold the table in memory). The slot, publication and tables are dropped afterwards.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from poller.snapshot.requests import chunk_size
from poller.sources.keyset.source import SqlSource
from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.config import PollerConfig
from shared.models import Batch
from tests.poller.pg_logical_support import LogicalTable, logical_reason, poller_config
from tests.support.databases import PG_URL, unreachable_reason

# The default: a tick's pages come from peeks that start at the slot's position, which moves only
# after the tick (each chunk's watermark means a new peek), so ticks stay short for both.
MAX_BATCHES = 20


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class EventSink:
    """Builds every event; records the commit → send latency of the writer's live rows."""

    def __init__(self) -> None:
        self.rows = 0
        self.latencies: list[float] = []  # from the commit (the log's commit time)
        self.from_insert: list[float] = []  # from the writer's clock before its INSERT

    def send(self, batch: Batch) -> None:
        now = time.time()
        for event in batch.events:
            self.rows += 1
            if event.change == "insert" and event.after and str(event.after.get("v", "")).startswith("t="):
                self.from_insert.append(now - float(str(event.after["v"])[2:]))
                if event.committed_at is not None:
                    self.latencies.append(now - event.committed_at.timestamp())

    def close(self) -> None:
        pass


def fill(table: LogicalTable, rows: int) -> None:
    with table.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table.name} (id, v, n) SELECT g, 'customer-' || g, g FROM generate_series(0, :n) g"),
            {"n": rows - 1},
        )
        conn.execute(sa.text(f"ANALYZE {table.name}"))


def keyset_rate(table: LogicalTable, batch: int) -> float:
    config = PollerConfig(
        name="bench_keyset", source_url=table.url, cursor="id", pk=("id",), queue="q", table=table.name,
        batch_size=batch, max_batches_per_tick=MAX_BATCHES, lease_ttl_seconds=3600, settle_seconds=0,
    )  # fmt: skip
    sink, store, source = EventSink(), MemoryStateStore(config.name), SqlSource(config)
    start = time.perf_counter()
    while run_tick(config, source, store, sink, owner_id="k").stop_reason != "caught_up":
        pass
    return sink.rows / (time.perf_counter() - start)


def snapshot_run(config: PollerConfig, sink: EventSink) -> float:
    """Ticks until the snapshot finished; returns the snapshot's rows per second."""
    return snapshot_state_run(config, sink)[0]


def snapshot_state_run(config: PollerConfig, sink: EventSink) -> tuple[float, int]:
    """Ticks until the snapshot finished; its rows per second and its refused chunk reads."""
    store, source = MemoryStateStore(config.name), PgLogicalSource(config)
    start = time.perf_counter()
    for _ in range(1_000_000):
        run_tick(config, source, store, sink, owner_id="s")
        snap = store.load()
        state = snap.doc.checkpoint.position.snapshot if snap and snap.doc.checkpoint.position else None
        if state is not None and not state.active:
            return state.rows / (time.perf_counter() - start), state.refused
    raise RuntimeError("the snapshot did not finish")


def write_rows(url: str, table: str, first_id: int, stop: Any, interval: float = 0.02) -> None:
    """One insert every ``interval`` s (its value the wall time before the INSERT) until ``stop`` is set."""
    engine = sa.create_engine(url)
    next_id = first_id
    while not stop.wait(interval):
        with engine.begin() as conn:
            statement = sa.text(f"INSERT INTO {table} (id, v, n) VALUES (:i, :v, 0)")
            conn.execute(statement, {"i": next_id, "v": f"t={time.time():.6f}"})
        next_id += 1
    engine.dispose()


class Writer:
    """The live stream's writer, in a process of its own (as an application is): a thread here would
    wait for this process's GIL to commit, and its commits would cluster where the poller waits."""

    def __init__(self, table: LogicalTable, first_id: int, interval: float = 0.02) -> None:
        context = multiprocessing.get_context("spawn")
        self.stop = context.Event()
        self._process = context.Process(target=write_rows, args=(table.url, table.name, first_id, self.stop, interval))

    def start(self) -> None:
        self._process.start()

    def join(self) -> None:
        self._process.join()


def stream_latency(config: PollerConfig, table: LogicalTable, seconds: float, first_id: int) -> EventSink:
    """The stream alone: ticks back to back for ``seconds`` while the writer writes."""
    sink, store, source = EventSink(), MemoryStateStore(config.name), PgLogicalSource(config)
    writer = Writer(table, first_id)
    writer.start()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        run_tick(config, source, store, sink, owner_id="l")
    writer.stop.set()
    writer.join()
    return sink


def snapshot_latency(config: PollerConfig, table: LogicalTable, seconds: float, first_id: int) -> EventSink:
    """Snapshots of the whole table back to back (each a new poller state) for ``seconds`` while the writer writes."""
    sink = EventSink()
    writer = Writer(table, first_id)
    writer.start()
    end = time.perf_counter() + seconds
    try:
        while time.perf_counter() < end:
            snapshot_run(config, sink)
    finally:
        writer.stop.set()
        writer.join()
    return sink


def busy_server(config: PollerConfig, table: LogicalTable, writers: int, interval: float, first_id: int) -> None:
    """A snapshot while ``writers`` processes commit every ``interval`` s each (transactions always in
    flight, as on a busy server), beside one on the quiet server: rows/s and refused chunk reads."""
    quiet, quiet_refused = snapshot_state_run(config, EventSink())
    running = [Writer(table, first_id + 1_000_000 * k, interval) for k in range(writers)]
    for writer in running:
        writer.start()
    try:
        busy, busy_refused = snapshot_state_run(config, EventSink())
    finally:
        for writer in running:
            writer.stop.set()
            writer.join()
    print(f"\nquiet: {quiet:,.0f} rows/s ({quiet_refused} chunk reads refused); busy, {writers} writer(s) committing "
          f"every {interval * 1000:g} ms: {busy:,.0f} rows/s ({busy_refused} refused); "
          f"load {Path('/proc/loadavg').read_text().split()[:3]}")  # fmt: skip


def figures(latencies: list[float]) -> str:
    if not latencies:
        return "-"
    ordered = sorted(latencies)
    p95 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]
    return f"{statistics.median(ordered) * 1000:.0f} / {p95 * 1000:.0f} ms ({len(ordered)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=0, help="snapshot_chunk_size (0: the default, 4 pages)")
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        help="then a snapshot while this many writer processes commit every --busy-ms (0: none)",
    )
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--no-latency", action="store_true", help="skip the latency phases")
    args = parser.parse_args()
    gc.collect()
    gc.freeze()  # as function_app.py does once the app is imported
    for reason in (unreachable_reason(PG_URL), logical_reason(PG_URL)):
        if reason:
            sys.exit(f"PostgreSQL: {reason}")
    table = LogicalTable(PG_URL)
    table.create(slot=False)
    try:
        fill(table, args.rows)
        table.create_slot()
        base = poller_config(
            table.url, table.name, signal_table=table.config.signal_table, batch_size=args.batch,
            max_batches_per_tick=MAX_BATCHES, lease_ttl_seconds=3600,
        )  # fmt: skip
        snap_config = replace(base, snapshot="initial", snapshot_chunk_size=args.chunk)
        print(
            f"{args.rows:,} rows, batches of {args.batch}, chunks of {chunk_size(snap_config)}; "
            f"load {Path('/proc/loadavg').read_text().split()[:3]}"
        )
        print("| round | keyset rows/s | snapshot rows/s | ratio | RSS MiB before → after snapshot |")
        print("|---:|---:|---:|---:|---:|")
        for round_ in range(1, args.repeat + 1):
            keyset = keyset_rate(table, args.batch)
            before = rss_mib()
            snapshot = snapshot_run(snap_config, EventSink())
            print(f"| {round_} | {keyset:,.0f} | {snapshot:,.0f} | {snapshot / keyset:.2f} | "
                  f"{before:.0f} → {rss_mib():.0f} |")  # fmt: skip
        if args.busy:
            busy_server(snap_config, table, args.busy, args.busy_ms / 1000, args.rows + 3_000_000)
        if args.no_latency:
            return
        # The live stream's latency, idle and during snapshots (the writer inserts ids past the table)
        idle = stream_latency(base, table, args.latency_seconds, args.rows + 1_000_000)
        during = snapshot_latency(snap_config, table, args.latency_seconds, args.rows + 2_000_000)
        print(f"\nlive stream commit → sink latency, median / p95 (samples): idle {figures(idle.latencies)}, "
              f"during snapshots {figures(during.latencies)}")  # fmt: skip
        print(f"(from the writer's clock before its INSERT: idle {figures(idle.from_insert)}, "
              f"during snapshots {figures(during.from_insert)})")  # fmt: skip
    finally:
        table.drop()


if __name__ == "__main__":
    main()
