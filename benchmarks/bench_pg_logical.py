"""kind = "pg_logical" catch-up throughput (issue 16). Run by hand; prints one table.

    .venv/bin/python benchmarks/bench_pg_logical.py                  # 50k changes, batches 500 and 1000
    .venv/bin/python benchmarks/bench_pg_logical.py --changes 200000 --txn 1000

Each round creates a table, its publication and slot, writes the changes (inserts, then updates
of a fifth of the rows and hard deletes of a tenth, in transactions of --txn changes), then:

raw peek   : pg_logical_slot_peek_binary_changes over the whole backlog, fetchall, no decoding
             (the server's own decoding cost: the ceiling for any client)
poller     : run_tick() until caught up: peek → pgoutput decode → batch → no-op sink → CAS commit
             on the in-memory state store → slot advance
+events    : the same with a sink that builds every event (ids, envelope fields)

Changes per second, the best of --repeat rounds (the machine is shared). The slot and the
publication are dropped afterwards, even on failure.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.models import Batch
from tests.poller.pg_logical_support import LogicalTable, logical_reason
from tests.support.databases import PG_URL, unreachable_reason


class NullSink:
    def send(self, batch: Batch) -> None:
        pass

    def close(self) -> None:
        pass


class EventSink(NullSink):
    def send(self, batch: Batch) -> None:
        for _ in batch.events:  # builds every event, as a sink that encodes them would
            pass


def write_changes(table: LogicalTable, changes: int, txn: int) -> int:
    inserts = changes * 100 // 130
    updates, deletes = inserts // 5, inserts // 10
    with table.engine.begin() as conn:  # the slot exists: every later commit is in it
        conn.execute(sa.text("SELECT 1"))
    for start in range(0, inserts, txn):
        rows = [{"id": i, "v": f"customer-{i}", "n": i} for i in range(start, min(start + txn, inserts))]
        with table.engine.begin() as conn:
            conn.execute(sa.text(f"INSERT INTO {table.name} (id, v, n) VALUES (:id, :v, :n)"), rows)
    for start in range(0, updates, txn):
        with table.engine.begin() as conn:
            conn.execute(
                sa.text(f"UPDATE {table.name} SET n = n + 1 WHERE id >= :a AND id < :b"),
                {"a": start, "b": min(start + txn, updates)},
            )
    for start in range(0, deletes, txn):
        with table.engine.begin() as conn:
            conn.execute(
                sa.text(f"DELETE FROM {table.name} WHERE id >= :a AND id < :b"),
                {"a": inserts - 1 - min(start + txn, deletes), "b": inserts - 1 - start},
            )
    return inserts + updates + deletes


def raw_peek(table: LogicalTable) -> float:
    query = sa.text(
        "SELECT data FROM pg_logical_slot_peek_binary_changes(CAST(:s AS name), NULL, NULL, "
        "'proto_version', '1', 'publication_names', :p)"
    )
    started = time.perf_counter()
    with table.engine.connect() as conn:
        conn.execute(query, {"s": table.config.slot, "p": table.config.publication}).fetchall()
    return time.perf_counter() - started


def drain(table: LogicalTable, batch: int, sink: NullSink) -> tuple[float, int]:
    config = replace(table.config, batch_size=batch, max_batches_per_tick=1000, lease_ttl_seconds=600)
    source, store = PgLogicalSource(config), MemoryStateStore(config.name)
    rows = 0
    started = time.perf_counter()
    while True:
        result = run_tick(config, source, store, sink, owner_id="bench")
        rows += result.rows
        if result.stop_reason == "caught_up":
            return time.perf_counter() - started, rows


def one_round(batch: int, changes: int, txn: int) -> tuple[float, float, float]:
    rates = []
    for measure in ("raw", "poller", "events"):
        table = LogicalTable(PG_URL)
        try:
            table.create()
            n = write_changes(table, changes, txn)
            if measure == "raw":
                rates.append(n / raw_peek(table))
                continue
            seconds, rows = drain(table, batch, EventSink() if measure == "events" else NullSink())
            assert rows == n, f"delivered {rows} of {n} changes"
            rates.append(n / seconds)
        finally:
            table.drop()
    return rates[0], rates[1], rates[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=50_000)
    parser.add_argument("--txn", type=int, default=100, help="changes per source transaction")
    parser.add_argument("--batch", type=int, action="append", help="batch_size (repeatable; default 500 and 1000)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    reason = unreachable_reason(PG_URL) or logical_reason(PG_URL)
    if reason:
        sys.exit(f"cannot run: {reason}")
    print(f"{args.changes} changes in transactions of {args.txn}; best of {args.repeat}")
    print("| batch | raw peek changes/s | poller changes/s | ratio | +events changes/s | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch or [500, 1000]:
        best = [0.0, 0.0, 0.0]
        for _ in range(args.repeat):
            best = [max(b, r) for b, r in zip(best, one_round(batch, args.changes, args.txn), strict=True)]
        raw, poller, events = best
        print(f"| {batch} | {raw:,.0f} | {poller:,.0f} | {poller / raw:.2f} | {events:,.0f} | {events / raw:.2f} |")


if __name__ == "__main__":
    main()
