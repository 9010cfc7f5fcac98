"""Poller catch-up vs. a raw keyset scan (issue 2). Run by hand; prints one comparable table.

    .venv/bin/python benchmarks/bench_poller.py                 # 100k rows, SQLite + PostgreSQL
    .venv/bin/python benchmarks/bench_poller.py --rows 1000000  # the "flat at 1M" check

raw scan   : the poller's own keyset SELECT, paged with plain SQLAlchemy Core (fetchall), no framework;
             each row materialized as a dict (the denominator of issue 14's target; the entries
             in BENCHMARKS.md before 2026-11-23 kept the fetched tuples)
packed     : THE HEADLINE. run_tick() until caught up with the real queue sink's packing (events,
             envelope, event ids, message ids) and a sender that discards the messages; state on
             Azurite (target ≥ 0.60 of raw at batch 1000, issue 14)
median     : the median of each round's packed ÷ raw (the two ran back to back)
writes/b   : state-blob writes per batch (target ≤ 2)
no-op      : the same with a sink that never reads the events: a LOWER BOUND of the framework's
             cost (lazy pages skip the per-row work every real sink does)
memory     : the no-op sink with the in-memory state store: the framework's own cost, without storage
+events    : the poller (Azurite) with a sink that builds every event object, but encodes nothing

Each figure is the best of --repeat rounds, the measures interleaved in each round (the machine is
shared; the best run is the least disturbed).
--depth sets max_uncommitted_batches (default: the configuration's default).

--baseline DIR compares the packed poller of this checkout with the one of another checkout (e.g.
``git worktree add /tmp/base <commit>``): both run in child processes with the same harness,
interleaved with the raw scan in each round, and the paired medians of both are printed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa

# DBFANOUT_BENCH_CODE: measure another checkout's code with this harness (see --baseline).
sys.path.insert(0, os.environ.get("DBFANOUT_BENCH_CODE") or str(Path(__file__).resolve().parents[1]))

from poller.sinks.queue import QueueSink
from poller.sources.keyset.resolve import RAW_CURSOR as _RAW_CURSOR
from poller.sources.keyset.source import SqlSource
from poller.state.blob import open_state_store
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.config import PollerConfig
from shared.models import Batch, Position
from shared.settings import StorageConnection
from tests.support.azurite import start_azurite
from tests.support.databases import PG_URL, unreachable_reason


def build_table(url: str, rows: int) -> str:
    """orders(id, updated_at timestamptz-ish, amount, note) with an index on (updated_at, id)."""
    engine = sa.create_engine(url)
    name = f"bench_{uuid.uuid4().hex[:8]}"
    md = sa.MetaData()
    table = sa.Table(
        name,
        md,
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("amount", sa.Numeric(12, 2)),
        sa.Column("note", sa.String(40)),
        sa.Index(f"ix_{name}_keyset", "updated_at", "id"),
    )
    md.create_all(engine)
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    chunk = 20_000
    with engine.begin() as conn:
        for lo in range(0, rows, chunk):
            conn.execute(
                table.insert(),
                [
                    {
                        "id": i,
                        # ~4 rows per timestamp: ties across page boundaries, like a busy table
                        "updated_at": start + dt.timedelta(milliseconds=(i // 4)),
                        "amount": i % 10_000,
                        "note": f"order {i}",
                    }
                    for i in range(lo, min(rows, lo + chunk))
                ],
            )
    if engine.dialect.name == "postgresql":  # hint bits and statistics now, not during the first timed scan
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(f"VACUUM ANALYZE {name}")
    engine.dispose()
    return name


DEPTH = PollerConfig(name="d", source_url="", cursor="c", pk=("id",), queue="q").max_uncommitted_batches


def drop_table(url: str, name: str) -> None:
    """Leave the database as it was (a 1M-row table would otherwise keep autovacuum busy)."""
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
    engine.dispose()


def poller_config(url: str, table: str, batch: int) -> PollerConfig:
    return PollerConfig(
        name=f"bench-{uuid.uuid4().hex[:6]}",
        source_url=url,
        table=table,
        cursor="updated_at",
        pk=("id",),
        queue="bench",
        batch_size=batch,
        max_batches_per_tick=100_000,
        max_uncommitted_batches=DEPTH,
        lease_ttl_seconds=600,
        settle_seconds=0,
        cursor_timezone="UTC",
    )


def raw_scan(cfg: PollerConfig) -> tuple[int, float]:
    """Page through with the poller's own SELECT, executed and bound by plain Core (no framework)."""
    source = SqlSource(cfg)
    first = source.keyset_query(None, cfg.batch_size)
    after = source.keyset_query(Position(cursor=_probe_cursor(cfg), pk={"id": -1}), cfg.batch_size)
    assert first is not None and after is not None
    engine = sa.create_engine(cfg.source_url)
    total, started = 0, time.perf_counter()
    with engine.connect() as conn:
        stmt, bind = first
        while True:
            result = conn.execute(stmt, bind)
            keys = list(result.keys())
            rows = result.fetchall()
            if not rows:
                break
            dicts = [dict(zip(keys, row, strict=True)) for row in rows]  # rows as dicts: what a handler gets
            assert len(dicts) == len(rows)
            total += len(rows)
            cursor_at = keys.index(_RAW_CURSOR if _RAW_CURSOR in keys else cfg.cursor)
            last = rows[-1]
            stmt, bind = after[0], {"dbf_limit": cfg.batch_size, "k0": last[cursor_at], "k1": last[keys.index("id")]}
    elapsed = time.perf_counter() - started
    engine.dispose()
    source.close()
    return total, elapsed


def _probe_cursor(cfg: PollerConfig) -> Any:
    """A cursor value of the right type, to obtain the 'after' statement once."""
    engine = sa.create_engine(cfg.source_url)
    with engine.connect() as conn:
        value = conn.exec_driver_sql(f"SELECT MIN(updated_at) FROM {cfg.table}").scalar_one()
    engine.dispose()
    return value


class NoopSink:
    """Accepts every batch at once; counts rows without asking for the events."""

    def __init__(self) -> None:
        self.events = 0

    def send(self, batch: Batch) -> None:
        self.events += len(batch.events)

    def close(self) -> None:
        pass


class BuildingSink(NoopSink):
    """Builds every event of every batch (what a real sink does before encoding), then drops them."""

    def send(self, batch: Batch) -> None:
        self.events += sum(1 for event in batch.events if event.event_id)


class _Discard:
    """A sender that accepts every message and drops it (no network in the measure)."""

    def send_all(self, messages: Any) -> None:
        pass

    def close(self) -> None:
        pass


class PackingSink(NoopSink):
    """The real queue sink (events, envelope, event and message ids), its messages discarded."""

    def __init__(self, cfg: PollerConfig) -> None:
        super().__init__()
        self._sink = QueueSink(cfg, _Discard(), limit=cfg.max_message_bytes)

    def send(self, batch: Batch) -> None:
        self._sink.send(batch)
        self.events += len(batch.events)


def poller_catch_up(
    cfg: PollerConfig, storage: str | None, sink_type: type[NoopSink] = NoopSink
) -> tuple[int, float, float]:
    """Catch up from scratch; state on Azurite, or in memory when ``storage`` is None."""
    store: Any = (
        open_state_store(StorageConnection(connection_string=storage), "bench-state", "bench", cfg.name)
        if storage
        else MemoryStateStore(cfg.name)
    )
    writes = {"n": 0}
    for name in ("commit", "heartbeat", "try_acquire", "release"):
        original = getattr(store, name)

        def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            writes["n"] += 1
            return _original(*args, **kwargs)

        setattr(store, name, counted)
    source, sink = SqlSource(cfg), (PackingSink(cfg) if sink_type is PackingSink else sink_type())
    started = time.perf_counter()
    batches = 0
    while True:
        result = run_tick(cfg, source, store, sink, owner_id="bench")
        batches += result.batches
        if result.stop_reason == "caught_up":
            break
    elapsed = time.perf_counter() - started
    source.close()
    return sink.events, elapsed, writes["n"] / max(batches, 1)


HERE = Path(__file__).resolve().parents[1]


def packed_in_child(code: Path, cfg: PollerConfig, storage: str) -> tuple[int, float, float]:
    """The packed catch-up run by ``code``'s modules in a child process (timed inside the child)."""
    env = {**os.environ, "DBFANOUT_BENCH_CODE": str(code)}
    args = [sys.executable, __file__, "--child", json.dumps([cfg.source_url, cfg.table, cfg.batch_size, cfg.name])]
    out = subprocess.run([*args, "--storage", storage], env=env, check=True, capture_output=True, text=True)
    rows, elapsed, per_batch = json.loads(out.stdout.splitlines()[-1])
    return rows, elapsed, per_batch


def child(spec: str, storage: str, depth: int) -> None:
    url, table, batch, name = json.loads(spec)
    cfg = replace(poller_config(url, table, batch), name=name, max_uncommitted_batches=depth)
    SqlSource(cfg).fetch(None, 1)  # untimed warm-up: engine, reflection, first connection
    print(json.dumps(poller_catch_up(cfg, storage, PackingSink)))


def best_rates(runs: int, measures: dict[str, Any]) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """Best rows/s of each measure over ``runs`` rounds, interleaved so that a disturbed period of a
    shared machine hits every measure alike. Values: (rows/s, writes per batch of that run); also,
    for every measure, the median over the rounds of its ratio to the first measure's (each round's
    measures ran back to back)."""
    best: dict[str, tuple[float, float]] = {name: (0.0, 0.0) for name in measures}
    first = next(iter(measures))
    ratios: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(runs):
        rates: dict[str, float] = {}
        for name, measure in measures.items():
            rows, elapsed, per_batch = measure()
            rates[name] = rows / elapsed
            if rates[name] > best[name][0]:
                best[name] = (rates[name], per_batch)
        for name in measures:
            ratios[name].append(rates[name] / rates[first])
    return best, {name: statistics.median(values) for name, values in ratios.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batches", type=int, nargs="+", default=[500, 1000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--depth", type=int, default=DEPTH, help="max_uncommitted_batches")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--baseline", type=Path, help="another checkout: compare its packed poller with this one")
    parser.add_argument(
        "--otel",
        action="store_true",
        help="tracing and metrics on: the OpenTelemetry SDK with the OTLP/HTTP exporter (shared.otel_setup) "
        "sending to a local sink (benchmarks/otlp_sink.py); compare with a run without it",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--storage", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.storage, args.depth)
        return

    sink = None
    if args.otel:
        from otlp_sink import OtlpSink  # beside this script

        from shared.otel_setup import configure_telemetry

        sink = OtlpSink().__enter__()
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.endpoint
        print(f"telemetry: {configure_telemetry()} to {sink.endpoint}")
    azurite = start_azurite()
    tmp = Path(tempfile.mkdtemp(prefix="dbfanout-bench-"))
    targets = [("sqlite-file", f"sqlite:///{tmp / 'bench.db'}")]
    if not args.no_postgres and unreachable_reason(PG_URL) is None:
        targets.append(("postgresql", PG_URL))
    print(
        f"rows={args.rows}  max_uncommitted_batches={args.depth}  best of {args.repeat}  "
        f"python={sys.version.split()[0]}  sqlalchemy={sa.__version__}"
    )
    if args.baseline:
        print(
            f"{'database':<12} {'batch':>6} {'raw (dicts)':>11} {'packed rows/s':>14} {'ratio':>6} {'median':>6}"
            f" {'baseline rows/s':>16} {'ratio':>6} {'median':>6}   (baseline: {args.baseline})"
        )
    else:
        print(
            f"{'database':<12} {'batch':>6} {'raw (dicts)':>11} {'packed rows/s':>14} {'ratio':>6} {'median':>6}"
            f" {'writes/b':>9} {'no-op (lower bound)':>20} {'ratio':>6}"
            f" {'memory rows/s':>14} {'ratio':>6} {'+events rows/s':>15} {'ratio':>6}"
        )
    runs = iter(range(1_000_000))
    built_tables: list[tuple[str, str]] = []
    try:
        for label, url in targets:
            table = build_table(url, args.rows)
            built_tables.append((url, table))
            for batch in args.batches:
                cfg = replace(poller_config(url, table, batch), max_uncommitted_batches=args.depth)

                def fresh(cfg: PollerConfig = cfg) -> PollerConfig:
                    return replace(cfg, name=f"{cfg.name}-{next(runs)}")  # each run catches up from scratch

                def checked(result: tuple[int, float, float]) -> tuple[int, float, float]:
                    assert result[0] == args.rows, (result[0], args.rows)
                    return result

                raw_scan(cfg)  # warm-up: caches and pools, untimed
                if args.baseline:
                    best, medians = best_rates(
                        args.repeat,
                        {
                            "raw": lambda cfg=cfg: checked((*raw_scan(cfg), 0.0)),
                            "packed": lambda: checked(packed_in_child(HERE, fresh(), azurite.connection_string)),
                            "baseline": lambda: checked(
                                packed_in_child(args.baseline, fresh(), azurite.connection_string)
                            ),
                        },
                    )
                    (raw, _), (packed, _), (base, _) = best.values()
                    print(
                        f"{label:<12} {batch:>6} {raw:>11,.0f} {packed:>14,.0f} {packed / raw:>6.2f}"
                        f" {medians['packed']:>6.2f} {base:>16,.0f} {base / raw:>6.2f} {medians['baseline']:>6.2f}",
                        flush=True,
                    )
                    continue
                best, medians = best_rates(
                    args.repeat,
                    {
                        "raw": lambda cfg=cfg: checked((*raw_scan(cfg), 0.0)),
                        "packed": lambda: checked(poller_catch_up(fresh(), azurite.connection_string, PackingSink)),
                        "noop": lambda: checked(poller_catch_up(fresh(), azurite.connection_string)),
                        "memory": lambda: checked(poller_catch_up(fresh(), None)),
                        "built": lambda: checked(poller_catch_up(fresh(), azurite.connection_string, BuildingSink)),
                    },
                )
                (raw, _), (packed, per_batch), (noop, _), (mem, _), (built, _) = best.values()
                print(
                    f"{label:<12} {batch:>6} {raw:>11,.0f} {packed:>14,.0f} {packed / raw:>6.2f}"
                    f" {medians['packed']:>6.2f} {per_batch:>9.2f} {noop:>20,.0f} {noop / raw:>6.2f}"
                    f" {mem:>14,.0f} {mem / raw:>6.2f} {built:>15,.0f} {built / raw:>6.2f}",
                    flush=True,
                )
    finally:
        azurite.stop()
        for url, table in built_tables:
            drop_table(url, table)
        if sink is not None:
            from shared.otel_setup import shutdown_telemetry

            shutdown_telemetry()  # flush, so the sink's counts are complete
            print(f"telemetry requests received: {sink.received}")
            sink.__exit__()


if __name__ == "__main__":
    main()
