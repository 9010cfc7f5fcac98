"""kind = "pg_logical" catch-up throughput (issue 16). Run by hand; prints one table.

    .venv/bin/python benchmarks/bench_pg_logical.py                  # 50k changes, batches 500 and 1000
    .venv/bin/python benchmarks/bench_pg_logical.py --changes 200000 --txn 1000
    .venv/bin/python benchmarks/bench_pg_logical.py --decode [--baseline /tmp/base-decode]

Each round creates a table, its publication and slot, writes the changes (inserts, then updates
of a fifth of the rows and hard deletes of a tenth, in transactions of --txn changes), then:

raw peek   : pg_logical_slot_peek_binary_changes over the whole backlog, fetchall, no decoding
             (the server's own decoding cost: the ceiling for any client)
poller     : run_tick() until caught up: peek → pgoutput decode → batch → no-op sink → CAS commit
             on the in-memory state store → slot advance
+events    : the same with a sink that builds every event (ids, envelope fields)

Changes per second, the best of --repeat rounds (the machine is shared), and the process's CPU
(every thread's) per change for the poller and +events rounds, the lowest. The slot and the
publication are dropped afterwards, even on failure.

``--decode``: the reader's own CPU per change, without the server: the backlog's pgoutput
messages are peeked once, then replayed (in a subprocess per measurement) through the peek loop
(``SlotReader._peek`` with the driver's stream replaced by the captured messages: tape, decode,
filter) and through ``PgLogicalSource.row`` for each change. CPU microseconds (the thread's)
per change, the best of --rounds runs in each subprocess. ``--baseline DIR`` runs the same in another tree's code
(``git worktree add /tmp/base-decode main``), interleaved with this tree's, --repeat times.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
# --code DIR: another tree's poller/ and shared/ first (the --decode baseline's subprocess).
sys.path.insert(0, sys.argv[sys.argv.index("--code") + 1] if "--code" in sys.argv else str(ROOT))

from poller.sources.pg_logical.source import PgLogicalSource  # noqa: E402
from poller.state.memory import MemoryStateStore  # noqa: E402
from poller.tick.lifecycle import run_tick  # noqa: E402
from shared.models import Batch  # noqa: E402
from tests.poller.pg_logical_support import LogicalTable, logical_reason  # noqa: E402
from tests.support.databases import PG_URL, unreachable_reason  # noqa: E402


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


TICKS: list[int] = []  # ticks each drain took (a tick that stops "caught_up" with more left: more than one)


def drain(table: LogicalTable, batch: int, sink: NullSink, n: int) -> tuple[float, int, float]:
    """Seconds, rows, and this process's CPU seconds (every thread's) to deliver the ``n`` changes.

    Ticks until all ``n`` arrived, not until the first "caught_up": a tick that stopped so while
    the slot held more (a peek's cap inside a transaction, before the fix) shows as extra ticks,
    which live come a whole timer period apart."""
    config = replace(table.config, batch_size=batch, max_batches_per_tick=1000, lease_ttl_seconds=600)
    source, store = PgLogicalSource(config), MemoryStateStore(config.name)
    rows = ticks = 0
    started, cpu = time.perf_counter(), time.process_time()
    while True:
        result = run_tick(config, source, store, sink, owner_id="bench")
        rows, ticks = rows + result.rows, ticks + 1
        if result.stop_reason == "caught_up" and (rows >= n or not result.rows):
            TICKS.append(ticks)
            return time.perf_counter() - started, rows, time.process_time() - cpu


def one_round(batch: int, changes: int, txn: int) -> tuple[float, ...]:
    """Changes/s of the raw peek, the poller and +events; then the poller's and +events' CPU µs per change."""
    rates, cpus = [], []
    for measure in ("raw", "poller", "events"):
        table = LogicalTable(PG_URL)
        try:
            table.create()
            n = write_changes(table, changes, txn)
            if measure == "raw":
                rates.append(n / raw_peek(table))
                continue
            seconds, rows, cpu = drain(table, batch, EventSink() if measure == "events" else NullSink(), n)
            assert rows == n, f"delivered {rows} of {n} changes"
            rates.append(n / seconds)
            cpus.append(cpu / n * 1e6)
        finally:
            table.drop()
    return rates[0], rates[1], rates[2], cpus[0], cpus[1]


def capture(table: LogicalTable) -> list[bytes]:
    """The slot's whole backlog as pgoutput messages (the ``data`` column, as the source reads it)."""
    query = (
        "SELECT data FROM pg_logical_slot_peek_binary_changes(CAST(%(s)s AS name), NULL, NULL, "
        "'proto_version', '1', 'publication_names', %(p)s)"
    )
    with table.engine.connect() as conn:
        driver: Any = conn.connection.driver_connection
        with driver.cursor(binary=True) as cursor:
            cursor.execute(query, {"s": table.config.slot, "p": table.config.publication})
            return [bytes(row[0]) for row in cursor.fetchall()]


def stream_cpu(table: LogicalTable) -> float:
    """The client's CPU seconds to stream the whole backlog off the server (no decoding)."""
    from poller.sources.pg_logical import peek

    params = {"slot": table.config.slot, "n": 1 << 30, "pub": table.config.publication}
    with table.engine.connect() as conn:
        started = time.thread_time()
        for _data in peek.stream(conn, peek._PEEK_SQL, params):
            pass
        return time.thread_time() - started


def measure_decode(path: str, url: str, name: str, rounds: int) -> dict[str, float]:
    """In this process's code (see --code): µs per change of the peek loop + decode, and of rows."""
    from poller.sources.pg_logical import peek
    from poller.sources.pg_logical.source import PgLogicalSource
    from shared.models import Lsn
    from tests.poller.pg_logical_support import poller_config

    messages: list[bytes] = pickle.loads(Path(path).read_bytes())

    def replay(_conn: sa.Connection, _query: str, params: dict[str, Any]) -> Iterator[bytes]:
        yield from messages[: params["n"]]

    peek.stream = replay  # type: ignore[assignment]  # the captured messages instead of the server's
    source = PgLogicalSource(poller_config(url, name))
    reader = peek.SlotReader(source._config, source._relations.wanted)
    best = {"decode": float("inf"), "rows": float("inf")}
    with source._engine.connect() as conn:
        for _ in range(rounds):
            started = time.thread_time()  # CPU time: what the box's other work does not inflate as much
            buffer = reader._peek(conn, len(messages) + 1, None, 1 << 40, Lsn(0))
            decoded = time.thread_time()
            row = source.row
            for c in buffer.changes:
                row(conn, c, None)
            done = time.thread_time()
            n = len(buffer.changes)
            best["decode"] = min(best["decode"], (decoded - started) / n * 1e6)
            best["rows"] = min(best["rows"], (done - decoded) / n * 1e6)
        reader.drop_spool()
    best["changes"] = n
    return best


def decode_figures(args: argparse.Namespace) -> None:
    """Decode + rows, µs per change: this tree and (``--baseline``) another, interleaved in subprocesses."""
    table = LogicalTable(PG_URL)
    try:
        table.create()
        n = write_changes(table, args.changes, args.txn)
        with tempfile.NamedTemporaryFile(suffix=".pickle", delete=False) as f:
            f.write(pickle.dumps(capture(table)))
        streamed = min(stream_cpu(table) for _ in range(args.rounds)) / n * 1e6
        trees = [("branch", str(ROOT))] + ([("baseline", args.baseline)] if args.baseline else [])
        results: dict[str, list[dict[str, float]]] = {label: [] for label, _ in trees}
        for _ in range(args.repeat):
            for label, code in trees:
                out = subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), "--code", code, "--measure-decode", f.name,
                     "--table", table.name, "--rounds", str(args.rounds)],
                    check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": code},
                )  # fmt: skip
                results[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
        os.unlink(f.name)
    finally:
        table.drop()
    print(f"{n} changes in transactions of {args.txn} (inserts, updates, deletes 100:20:10); "
          f"best of {args.rounds} runs per subprocess, {args.repeat} subprocesses per tree, interleaved")  # fmt: skip
    print(f"the driver's stream of the same peek (this tree's peek.stream, unchanged): {streamed:.2f} µs/change of CPU")
    print("| code | peek loop + decode µs/change | rows µs/change | total µs/change | runs (decode+rows) |")
    print("|---|---:|---:|---:|---|")
    for label, runs in results.items():
        dec, rows = min(r["decode"] for r in runs), min(r["rows"] for r in runs)
        each = ", ".join(f"{r['decode'] + r['rows']:.2f}" for r in runs)
        print(f"| {label} | {dec:.2f} | {rows:.2f} | {dec + rows:.2f} | {each} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=50_000)
    parser.add_argument("--txn", type=int, default=100, help="changes per source transaction")
    parser.add_argument("--batch", type=int, action="append", help="batch_size (repeatable; default 500 and 1000)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gc-threshold", type=int, help="gc.set_threshold(N) first: the cyclic GC's share of the CPU")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() first, as function_app.py does")
    parser.add_argument("--decode", action="store_true", help="the reader's CPU per change (decode + rows) instead")
    parser.add_argument("--baseline", help="--decode: another tree to measure interleaved (e.g. /tmp/base-decode)")
    parser.add_argument("--rounds", type=int, default=5, help="--decode: runs per subprocess (the best counts)")
    parser.add_argument("--code", help=argparse.SUPPRESS)  # read at import: the tree whose code runs
    parser.add_argument("--measure-decode", help=argparse.SUPPRESS)  # a --decode subprocess: the messages' file
    parser.add_argument("--table", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gc_threshold:
        gc.set_threshold(args.gc_threshold)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    if args.measure_decode:
        print(json.dumps(measure_decode(args.measure_decode, PG_URL, args.table, args.rounds)))
        return
    reason = unreachable_reason(PG_URL) or logical_reason(PG_URL)
    if reason:
        sys.exit(f"cannot run: {reason}")
    if args.decode:
        decode_figures(args)
        return
    print(f"{args.changes} changes in transactions of {args.txn}; best of {args.repeat}")
    print("| batch | raw peek changes/s | poller changes/s | ratio | +events changes/s | ratio "
          "| poller CPU µs/change | +events CPU µs/change |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch or [500, 1000]:
        best = [0.0, 0.0, 0.0, float("inf"), float("inf")]
        for _ in range(args.repeat):
            got = one_round(batch, args.changes, args.txn)
            best = [max(best[i], got[i]) for i in range(3)] + [min(best[i], got[i]) for i in (3, 4)]
        raw, poller, events, poller_cpu, events_cpu = best
        print(f"| {batch} | {raw:,.0f} | {poller:,.0f} | {poller / raw:.2f} | {events:,.0f} | {events / raw:.2f} "
              f"| {poller_cpu:.1f} | {events_cpu:.1f} |")  # fmt: skip
        print(f"ticks per drain (batch {batch}): {TICKS}")
        TICKS.clear()


if __name__ == "__main__":
    main()
