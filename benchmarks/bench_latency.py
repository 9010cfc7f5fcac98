"""Commit-to-handler latency and host memory under ``dbfanout run`` (run by hand).

    python benchmarks/bench_latency.py latency [--rate 1000] [--seconds 60]
    python benchmarks/bench_latency.py catchup [--rows 1000000]

Both run the real ``function_app.py`` under ``dbfanout run`` as a child process, against Azurite,
the project's Service Bus emulator (on a thread of this process) and a SQLite source in WAL mode.

* latency: a writer commits ``--rate`` rows/s in 20 small transactions per second, each row
  stamped with its commit time; the poller runs every second (``*/1 * * * * *``). A handler
  records, per event, handler time minus commit time. Reports p50/p95/p99/max after a warm-up.
  Target: p99 <= 2 s.
* catchup: ``--rows`` rows exist before the host starts; the host drains them while its RSS
  (``/proc/<pid>/status`` VmRSS) is sampled every second. Target: flat, not growing with backlog.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from sbemulator.testing import running_emulator, unique_queue  # noqa: E402
from tests.host.app_support import AppDir, HostProcess, sqlite_engine, wait_for  # noqa: E402
from tests.support.azurite import start_azurite  # noqa: E402

HANDLER = '''
"""Benchmark handler: appends, per message, each event's commit-to-handler latency."""
import os, threading, time
_lock = threading.Lock()
_path = os.environ["BENCH_OUT"]

def handle(events, context):
    now = time.time()
    lines = "".join(f"{now - e.after['committed_at']:.6f}\\n" for e in events)
    with _lock, open(_path, "a") as f:
        f.write(lines)
'''

CONFIG = """
[app]
name = "{name}"

[pollers.orders]
source_url = "${{ORDERS_DB_URL}}"
table = "orders"
cursor = "version"
pk = ["id"]
queue = "{queue}"
schedule = "*/1 * * * * *"
batch_size = {batch}
max_batches_per_tick = 20
lease_ttl_seconds = 60
settle_seconds = 0
handler = "bench_handler:handle"
"""


def _prepare(tmp: Path, batch: int) -> tuple[AppDir, object, object]:
    azurite = start_azurite()
    emulator_cm = running_emulator()
    emulator = emulator_cm.__enter__()
    queue = unique_queue(
        emulator, "bench", requires_duplicate_detection=True, lock_duration="PT60S", max_size_bytes=4 * 1024**3
    )
    app = AppDir.create(
        tmp / "app", queue=queue, storage=azurite.connection_string, servicebus=emulator.connection_string
    )
    (app.root / "bench_handler.py").write_text(HANDLER)
    (app.root / "dbfanout.toml").write_text(CONFIG.format(name=app.app_name, queue=queue, batch=batch))
    return app, azurite, emulator_cm


def _create_source(path: Path) -> sa.Engine:
    engine = sqlite_engine(path)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, v TEXT, committed_at FLOAT)"
        )
        conn.exec_driver_sql("CREATE INDEX ix_orders_keyset ON orders (version, id)")
    return engine


def _lines(path: Path) -> list[float]:
    return [float(x) for x in path.read_text().split()] if path.exists() else []


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def latency(args: argparse.Namespace, tmp: Path) -> None:
    app, azurite, emulator_cm = _prepare(tmp, batch=500)
    out = app.root / "latency.txt"
    os.environ["BENCH_OUT"] = str(out)
    engine = _create_source(app.root / "source.db")
    host = HostProcess(app).start()
    stop = threading.Event()
    written = [0]

    def writer() -> None:
        per_txn = max(1, args.rate // 20)
        next_at = time.monotonic()
        while not stop.is_set():
            with engine.begin() as conn:
                base = written[0]
                now = time.time()
                conn.execute(
                    sa.text("INSERT INTO orders (id, version, v, committed_at) VALUES (:i, :i, 'x', :t)"),
                    [{"i": base + k + 1, "t": now} for k in range(per_txn)],
                )
            written[0] += per_txn
            next_at += 0.05
            time.sleep(max(0.0, next_at - time.monotonic()))

    try:
        wait_for(host.started, 60, "the host to start")
        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        time.sleep(args.seconds)
        stop.set()
        thread.join()
        wait_for(lambda: len(_lines(out)) >= written[0], 120, "every row to be handled")
        values = _lines(out)
        steady = values[int(len(values) * args.warmup) :]
        print(f"rows={written[0]} rate={written[0] / args.seconds:.0f}/s handled={len(values)} measured={len(steady)}")
        print(
            f"latency s: p50={_pct(steady, 50):.3f} p95={_pct(steady, 95):.3f} p99={_pct(steady, 99):.3f} "
            f"max={max(steady):.3f} mean={statistics.fmean(steady):.3f}"
        )
    finally:
        host.stop_quietly()
        emulator_cm.__exit__(None, None, None)  # type: ignore[attr-defined]
        azurite.stop()  # type: ignore[attr-defined]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def catchup(args: argparse.Namespace, tmp: Path) -> None:
    app, azurite, emulator_cm = _prepare(tmp, batch=1000)
    out = app.root / "latency.txt"
    os.environ["BENCH_OUT"] = str(out)
    engine = _create_source(app.root / "source.db")
    with engine.begin() as conn:
        for start in range(0, args.rows, 50_000):
            stop = min(args.rows, start + 50_000)
            conn.execute(
                sa.text("INSERT INTO orders (id, version, v, committed_at) VALUES (:i, :i, :v, :t)"),
                [{"i": i + 1, "v": f"row-{i}", "t": time.time()} for i in range(start, stop)],
            )
    host = HostProcess(app).start()
    samples: list[tuple[float, int, float]] = []
    started = time.monotonic()
    try:
        assert host.proc is not None
        while True:
            handled = out.stat().st_size // 9 if out.exists() else 0  # ~9 bytes a line; exact count at the end
            samples.append((time.monotonic() - started, handled, _rss_mb(host.proc.pid)))
            if handled >= args.rows and len(_lines(out)) >= args.rows:
                break
            if time.monotonic() - started > args.timeout:
                raise TimeoutError("the catch-up did not finish")
            time.sleep(1.0)
        elapsed = time.monotonic() - started
        print(f"rows={args.rows} elapsed={elapsed:.0f}s throughput={args.rows / elapsed:.0f} rows/s")
        step = max(1, len(samples) // 12)
        for t, n, rss in samples[::step]:
            print(f"  t={t:6.0f}s handled~{n:>9} rss={rss:7.1f} MB")
        rss_values = [s[2] for s in samples[5:]] or [s[2] for s in samples]
        peak = max(s[2] for s in samples)
        print(f"peak rss={peak:.1f} MB; after warm-up min={min(rss_values):.1f} max={max(rss_values):.1f} MB")
    finally:
        host.stop_quietly()
        emulator_cm.__exit__(None, None, None)  # type: ignore[attr-defined]
        azurite.stop()  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="mode", required=True)
    lat = sub.add_parser("latency")
    lat.add_argument("--rate", type=int, default=1000, help="rows per second")
    lat.add_argument("--seconds", type=float, default=60.0)
    lat.add_argument("--warmup", type=float, default=0.1, help="fraction of the first events not measured")
    cat = sub.add_parser("catchup")
    cat.add_argument("--rows", type=int, default=1_000_000)
    cat.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    try:
        latency(args, tmp) if args.mode == "latency" else catchup(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
