"""µs per change from a fetched page to the message bytes a sink sends (issue 41: the tick thread).

Times ``page_batch`` → ``page_batches`` (epochs) → ``pack_batch`` (event ids, encoding, packing,
message ids) for 500-row pages, as the tick and the queue sink run them. Rows are built before the
clock starts: building them is the source's work.

- ``pg``: pg_logical-shaped rows (``PgLogicalSource.row``): 7 columns (int, text, numeric,
  timestamptz, int, nullable text, jsonb), 10-row commits, inserts/updates/deletes of one table.
- ``pg_wide``: the same with a full before image on updates and two tables in one page.
- ``pg_plain``: the same without the numeric and jsonb columns (5 columns, all inserts).
- ``keyset``: a keyset page handed over as tuples (6 columns).

``--baseline PATH`` also runs the same benchmark on another checkout's code (e.g.
``git worktree add /tmp/base-encode main``) in a subprocess, interleaved with this checkout's, each
side best of ``--rounds``. Figures are CPU µs per change (the thread's CPU time, not the wall
clock: the machine is shared) and the changes/s one core would give at that cost. ``--profile``
prints the top cProfile entries of this checkout's code.

    .venv/bin/python benchmarks/bench_encode.py --baseline /tmp/base-encode --rounds 7
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import json
import os
import pstats
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any

ROWS = 500
SHAPES = ("pg", "pg_wide", "pg_plain", "keyset")


def _pg_rows(count: int, wide: bool, plain: bool = False) -> list[Any]:
    from poller.ports import EventFields, SourceRow
    from shared.models import Lsn, Position

    rows = []
    base = dt.datetime(2026, 11, 29, 1, 0, 0, 0, tzinfo=dt.UTC)
    lsn, when = Lsn(0x16_0000_0000), base
    for i in range(count):
        seq = i % 10
        if seq == 0:
            lsn, when = Lsn(lsn + 0x2A8), when + dt.timedelta(milliseconds=3)
        table = "public.order_lines" if wide and i % 3 == 0 else "public.orders"
        new = {
            "id": 100_000 + i,
            "status": ("paid", "new", "shipped", "ünïcode")[i % 4],
            "amount": Decimal(f"{i % 997}.{i % 100:02d}"),
            "updated_at": when + dt.timedelta(microseconds=i),
            "qty": i % 17,
            "note": None if i % 2 else f"note {i}",
            "payload": {"n": i, "tags": ["a", "b"]},
        }
        kind = ("insert", "insert", "insert", "update", "update", "insert", "delete", "insert", "update", "insert")[
            i % 10
        ]
        if plain:
            del new["amount"], new["payload"]
            kind = "insert"
        old = {**new, "status": "old"} if wide and kind == "update" else None
        if kind == "delete":
            old, new_image = {"id": new["id"]}, None
        else:
            new_image = new
        image = old if kind == "delete" else new_image
        assert image is not None
        fields = EventFields(
            pk={"id": image["id"]}, cursor=(lsn, seq), change=kind, before=old, table=table, committed_at=when
        )
        rows.append(SourceRow(Position(lsn, {"seq": seq}, None), dict(new_image or {}), kind == "delete", fields))
    return rows


def _keyset_tuples(count: int) -> tuple[Any, list[tuple[Any, ...]]]:
    from poller.ports import KeysetColumns

    columns = KeysetColumns(
        keys=("id", "version", "status", "amount", "updated_at", "qty"), cursor="version", pk=("id",)
    )
    base = dt.datetime(2026, 11, 29, 1, 0, 0, 0, tzinfo=dt.UTC)
    tuples = [
        (i, 5_000_000 + i, ("paid", "new")[i % 2], Decimal(i) / 4, base + dt.timedelta(seconds=i), i % 9)
        for i in range(count)
    ]
    return columns, tuples


def _runner(shape: str) -> Callable[[], int]:
    """One page → message bytes; returns the bytes sent (so nothing is optimised away)."""
    from poller.ports import Page
    from poller.tick.epochs import Order, page_batches
    from poller.tick.events import page_batch
    from shared.config import PollerConfig
    from shared.messages import pack_batch

    read_at = dt.datetime(2026, 11, 29, tzinfo=dt.UTC)
    if shape == "keyset":
        poller = PollerConfig(
            name="orders", source_url="sqlite://", cursor="version", pk=("id",), queue="q", table="orders"
        )
        columns, tuples = _keyset_tuples(ROWS)
        make_row = columns.row_builder()

        def page() -> Page:
            return Page(tuples=tuples, make_row=make_row, columns=columns)
    else:
        poller = PollerConfig(
            name="orders",
            source_url="postgresql://x/y",
            cursor="version",
            pk=(),
            queue="q",
            table="public.orders",
            kind="pg_logical",
        )
        rows = _pg_rows(ROWS, shape == "pg_wide", shape == "pg_plain")

        def page() -> Page:
            return Page(rows)

    def run() -> int:
        p = page()
        batches, _ = page_batches(poller, "sha256:bench", p, page_batch(poller, "sha256:bench", p), Order())
        sent = 0
        for batch in batches:
            for m in pack_batch(replace(batch, read_at=read_at), 256 * 1024):
                sent += len(m.body)
        return sent

    return run


def measure(shape: str, pages: int, repeats: int) -> float:
    """Best CPU µs per change (this thread's CPU time: on a shared, busy machine the wall clock
    also counts the time spent waiting for a core) over ``repeats`` runs of ``pages`` pages."""
    run = _runner(shape)
    run()  # warm up (imports, caches)
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(pages):
            run()
        best = min(best, (time.thread_time() - start) / (pages * ROWS) * 1e6)
    return best


def _worker(path: str, shapes: list[str], pages: int, repeats: int) -> dict[str, float]:
    """One side's figures, measured in a fresh process on the code at ``path``."""
    env = {**os.environ, "PYTHONPATH": path}
    args = [sys.executable, __file__, "--worker", "--pages", str(pages), "--repeats", str(repeats), *shapes]
    out = subprocess.run(args, env=env, cwd=path, check=True, capture_output=True, text=True).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def _profile(shape: str, pages: int) -> None:
    run = _runner(shape)
    run()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(pages):
        run()
    profiler.disable()
    print(f"--- cProfile, {shape}: {pages} pages of {ROWS} rows")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def main() -> None:
    """Measure, and compare against ``--baseline`` when given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("shapes", nargs="*", help=f"any of {', '.join(SHAPES)} (default: all)")
    parser.add_argument("--pages", type=int, default=10, help="pages per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per process (best kept)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved processes per side (best kept)")
    parser.add_argument("--baseline", help="another checkout to compare with (its code, this benchmark)")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries for this checkout")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = args.shapes or list(SHAPES)
    if unknown := set(shapes) - set(SHAPES):
        parser.error(f"unknown shape(s): {', '.join(sorted(unknown))}")
    if args.worker:
        print(json.dumps({s: measure(s, args.pages, args.repeats) for s in shapes}))
        return
    if args.profile:
        for shape in shapes:
            _profile(shape, args.pages)
        return
    here = str(Path(__file__).resolve().parent.parent)
    sides = {"this": here, **({"baseline": args.baseline} if args.baseline else {})}
    best: dict[str, dict[str, float]] = {side: {} for side in sides}
    for _ in range(args.rounds):
        for side, path in sides.items():
            for shape, value in _worker(path, shapes, args.pages, args.repeats).items():
                best[side][shape] = min(best[side].get(shape, float("inf")), value)
    print(
        f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} (1, 5 min); {ROWS}-row pages, best of {args.rounds}"
    )
    for shape in shapes:
        line = f"{shape:8s} this {best['this'][shape]:6.2f} CPU µs/change ({1e6 / best['this'][shape]:9,.0f} changes/s)"
        if "baseline" in best:
            base = best["baseline"][shape]
            line += f"  baseline {base:6.2f} µs/change ({1e6 / base:9,.0f}/s)  x{base / best['this'][shape]:.2f}"
        print(line)


if __name__ == "__main__":
    main()
