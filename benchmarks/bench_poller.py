"""Poller catch-up vs. a raw keyset scan (issue 2). Run by hand; prints one comparable table.

    .venv/bin/python benchmarks/bench_poller.py                 # 100k rows, SQLite + PostgreSQL
    .venv/bin/python benchmarks/bench_poller.py --rows 1000000  # the "flat at 1M" check

raw scan   : the poller's own keyset SELECT, paged with plain SQLAlchemy Core (fetchall), no framework
poller     : run_tick() until caught up: fetch → batch → no-op sink → CAS commit on Azurite
ratio      : poller rows/s ÷ raw rows/s, best against best (target ≥ 0.70 at batch 1000)
median     : the median of each round's poller ÷ raw (the two ran back to back)
writes/b   : state-blob writes per batch (target ≤ 2)
memory     : the poller with the in-memory state store: the framework's own cost, without storage
+events    : the poller (Azurite) with a sink that builds every event (ids, ops, values): the
             per-row normalisation a real sink pays for, which a no-op sink never asks for

Each figure is the best of --repeat rounds, the four measures interleaved in each round (the
machine is shared; the best run is the least disturbed).
--depth sets max_uncommitted_batches (default: the configuration's default).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from poller.source import (
    _RAW_CURSOR,
    SqlSource,
)
from poller.state_blob import open_state_store
from poller.state_memory import MemoryStateStore
from poller.tick import run_tick
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
    source, sink = SqlSource(cfg), sink_type()
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


def best_rates(runs: int, measures: dict[str, Any]) -> tuple[dict[str, tuple[float, float]], float]:
    """Best rows/s of each measure over ``runs`` rounds, interleaved so that a disturbed period of a
    shared machine hits every measure alike. Values: (rows/s, writes per batch of that run); also
    the median over the rounds of the first two measures' ratio (each round's pair ran back to back)."""
    best: dict[str, tuple[float, float]] = {name: (0.0, 0.0) for name in measures}
    first, second = list(measures)[:2]
    ratios: list[float] = []
    for _ in range(runs):
        rates: dict[str, float] = {}
        for name, measure in measures.items():
            rows, elapsed, per_batch = measure()
            rates[name] = rows / elapsed
            if rates[name] > best[name][0]:
                best[name] = (rates[name], per_batch)
        ratios.append(rates[second] / rates[first])
    return best, statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batches", type=int, nargs="+", default=[500, 1000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--depth", type=int, default=DEPTH, help="max_uncommitted_batches")
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()

    azurite = start_azurite()
    tmp = Path(tempfile.mkdtemp(prefix="dbfanout-bench-"))
    targets = [("sqlite-file", f"sqlite:///{tmp / 'bench.db'}")]
    if not args.no_postgres and unreachable_reason(PG_URL) is None:
        targets.append(("postgresql", PG_URL))
    print(
        f"rows={args.rows}  max_uncommitted_batches={args.depth}  best of {args.repeat}  "
        f"python={sys.version.split()[0]}  sqlalchemy={sa.__version__}"
    )
    print(
        f"{'database':<12} {'batch':>6} {'raw rows/s':>11} {'poller rows/s':>14} {'ratio':>6} {'median':>6}"
        f" {'writes/b':>9}"
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
                best, median = best_rates(
                    args.repeat,
                    {
                        "raw": lambda cfg=cfg: checked((*raw_scan(cfg), 0.0)),
                        "poller": lambda: checked(poller_catch_up(fresh(), azurite.connection_string)),
                        "memory": lambda: checked(poller_catch_up(fresh(), None)),
                        "built": lambda: checked(poller_catch_up(fresh(), azurite.connection_string, BuildingSink)),
                    },
                )
                (raw, _), (poll, per_batch), (mem, _), (built, _) = best.values()
                print(
                    f"{label:<12} {batch:>6} {raw:>11,.0f} {poll:>14,.0f} {poll / raw:>6.2f} {median:>6.2f}"
                    f" {per_batch:>9.2f}"
                    f" {mem:>14,.0f} {mem / raw:>6.2f} {built:>15,.0f} {built / raw:>6.2f}",
                    flush=True,
                )
    finally:
        azurite.stop()
        for url, table in built_tables:
            drop_table(url, table)


if __name__ == "__main__":
    main()
