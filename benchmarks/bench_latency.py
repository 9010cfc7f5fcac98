"""Commit-to-handler latency and host memory under ``dbfanout run`` (run by hand).

    python benchmarks/bench_latency.py latency [--rate 1000] [--seconds 60] [--linger 1 --poll-ms 50]
                                               [--db sqlite|postgresql|pg_logical] [--wake notify|wal]
                                               [--txn-per-s 20] [--db-cost]
                                               [--batch 500] [--max-batches N] [--snapshot-rows N]
    python benchmarks/bench_latency.py catchup [--rows 1000000] [--baseline DIR]

Both run the real ``function_app.py`` under ``dbfanout run`` as a child process, against Azurite,
the project's Service Bus emulator and a SQLite source in WAL mode.

* latency: a writer commits ``--rate`` rows/s in 20 small transactions per second, each row
  stamped with its commit time; the poller runs every second (``*/1 * * * * *``). A handler
  records, per event, handler time minus commit time. Reports p50/p95/p99/max after a warm-up.
  ``--linger S`` sets ``linger_seconds`` (the tick polls every ``--poll-ms`` until 0.1 s before the
  next second); ``--db postgresql`` uses a PostgreSQL schema of its own with ``xid_column``, and
  ``--wake notify`` (with it) wakes the linger by LISTEN/NOTIFY instead of polling; ``--db
  pg_logical`` reads a published table through a replication slot (wal_level = logical); with it
  ``--wake wal`` wakes the linger when the WAL flush position moves (no trigger). ``--txn-per-s``
  sets the writer's transactions a second (``--rate`` rows spread over them). ``--db-cost`` (with
  ``--db pg_logical``) runs in a database of its own and reports the poller's cost on the server
  while the writer runs: the CPU of its backends (application_name bench_poller, read from /proc:
  the server must run on this machine), the writer's backends' CPU (bench_writer: a trigger and
  the notify lock are paid there), and the database's transactions a second less the writer's.
  Targets: p99 <= 2 s; with linger p50 <= 0.10 s, p99 <= 0.25 s (issue 23).
  ``--snapshot-rows N`` (with ``--db pg_logical``; issue 25): a second table of N rows, written
  before the slot, is among the poller's tables (own signal table). After ``--seconds`` of the
  stream alone (idle), ``dbfanout snapshot orders --table T`` queues a snapshot of it and the run
  lasts until the handler has seen all N rows (size N so it lasts: one snapshot per run, since a
  second one's pages would largely repeat the first's message ids, which duplicate detection drops).
  Prints the idle figure (rows committed after the warm-up, before the request) and the
  during-snapshot figure (rows committed between the first and the last snapshot row handled),
  each split at the message's enqueued time (poller side / worker side), and the snapshot's rows/s.
* catchup: ``--rows`` rows (default 200k; 1000000 for the headline) exist before the host starts;
  the host drains them while its RSS (``/proc/<pid>/status`` VmRSS) is sampled. The emulator runs
  in its own process here, so each process's CPU time per row is reported too. rows/s is measured
  from the first to the last handler call; ``incl.start`` from the host's start. With the 1 s
  schedule a tick hands over at most batch_size x max_batches_per_tick rows a second: ``--max-batches``
  (default 200) keeps that cap above what the pipeline does; 20 (the old value) caps it at 20k rows/s.
  Target: >= 45,000 rows/s for 1M rows, RSS flat.

    python benchmarks/bench_latency.py catchup --baseline /tmp/base [--repeat 3] [--profile DIR]

``--baseline DIR`` runs the same harness on another checkout (``git worktree add /tmp/base COMMIT``):
its host and its emulator (``PYTHONPATH=DIR``, its ``function_app.py`` and ``host.json``), the two
alternating round by round, one table for both. ``--profile DIR`` runs both processes under
``benchmarks/profiled.py`` (a CPU-weighted sampler on every thread) and writes ``DIR/<contestant>/{host,emulator}.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from sbemulator.testing import running_emulator, unique_queue  # noqa: E402
from tests.host.app_support import AppDir, HostProcess, sqlite_engine, wait_for  # noqa: E402
from tests.support.azurite import start_azurite  # noqa: E402

HANDLER = '''
"""Benchmark handler: appends, per message, each live event's commit time, commit-to-handler
latency and the message's enqueued time (BENCH_OUT), and per message of snapshot rows ("read"
events) their count and the time (BENCH_OUT + ".snapshot")."""
import os, threading, time
_lock = threading.Lock()
_path = os.environ["BENCH_OUT"]

def handle(events, context):
    now = time.time()
    live = [e.after["committed_at"] for e in events if e.change != "read"]
    enqueued = context.enqueued_time.timestamp() if context.enqueued_time else float("nan")
    lines = "".join(f"{c:.6f} {now - c:.6f} {enqueued:.6f}\\n" for c in live)
    read = len(events) - len(live)
    with _lock:
        with open(_path, "a") as f:
            f.write(lines)
        if read:
            with open(_path + ".snapshot", "a") as f:
                f.write(f"{read} {now:.6f}\\n")
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
max_batches_per_tick = {max_batches}
lease_ttl_seconds = 60
settle_seconds = 0
handler = "bench_handler:handle"
{more}
"""


def _prepare(tmp: Path, batch: int, more: str = "", source_url: str | None = None) -> tuple[AppDir, object, object]:
    azurite = start_azurite()
    emulator_cm = running_emulator()
    emulator = emulator_cm.__enter__()
    queue = unique_queue(
        emulator, "bench", requires_duplicate_detection=True, lock_duration="PT60S", max_size_bytes=4 * 1024**3
    )
    app = AppDir.create(
        tmp / "app",
        queue=queue,
        storage=azurite.connection_string,
        servicebus=emulator.connection_string,
        source_url=source_url,
    )
    (app.root / "bench_handler.py").write_text(HANDLER)
    config = CONFIG.format(name=app.app_name, queue=queue, batch=batch, max_batches=20, more=more)
    (app.root / "dbfanout.toml").write_text(config)
    return app, azurite, emulator_cm


def _create_source(path: Path) -> sa.Engine:
    engine = sqlite_engine(path)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, v TEXT, committed_at FLOAT)"
        )
        conn.exec_driver_sql("CREATE INDEX ix_orders_keyset ON orders (version, id)")
    return engine


def _rows(path: Path) -> list[tuple[float, ...]]:
    """The handler's lines: (commit time, latency, enqueued time) per live event, or (rows, time)
    per snapshot message."""
    if not path.exists():
        return []
    return [tuple(float(x) for x in line.split()) for line in path.read_text().splitlines() if line]


def _lines(path: Path) -> list[float]:
    """The latencies, in the order handled."""
    return [row[1] for row in _rows(path)]


def _figures(values: list[float]) -> str:
    if not values:
        return "p50=- p95=- p99=- max=- mean=- (no samples)"
    return (
        f"p50={_pct(values, 50):.3f} p95={_pct(values, 95):.3f} p99={_pct(values, 99):.3f} "
        f"max={max(values):.3f} mean={statistics.fmean(values):.3f}"
    )


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def _create_pg_source(url: str) -> sa.Engine:
    """PostgreSQL: the same table plus a transaction-id column for the poller's xid horizon."""
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, v TEXT, committed_at FLOAT, "
            "txid xid8 NOT NULL DEFAULT pg_current_xact_id())"
        )
        conn.exec_driver_sql("CREATE INDEX ix_orders_keyset ON orders (version, id)")
    return engine


PG_LOGICAL = """
[app]
name = "{name}"

[pollers.orders]
kind = "pg_logical"
source_url = "${{ORDERS_DB_URL}}"
tables = ["{table}"]
slot = "{table}"
publication = "{table}"
queue = "{queue}"
schedule = "*/1 * * * * *"
batch_size = {batch}
lease_ttl_seconds = 60
handler = "bench_handler:handle"
{more}
"""


def _pg_logical_source(
    app: AppDir, more: str, batch: int = 500, snapshot_rows: int = 0, url: str | None = None
) -> tuple[sa.Engine, Any]:
    """A published table with its slot (wal_level = logical); returns the engine and (the table, a
    cleanup, the snapshot table). With ``snapshot_rows``, a second table of that many rows, written
    before the slot exists (rows only a snapshot delivers), is among the poller's tables, and the
    poller has a signal table of its own."""
    from poller.sources.pg_logical.source import setup_sql
    from shared.config import parse_config
    from tests.support.databases import PG_URL, unique_name

    PG_URL = url or PG_URL  # --db-cost: the database of its own
    table = unique_name("lglat")
    snap = f"{table}_snap" if snapshot_rows else None
    queue = re.search(r'queue = "([^"]+)"', (app.root / "dbfanout.toml").read_text())
    assert queue is not None
    text = PG_LOGICAL.format(name=app.app_name, table=table, queue=queue.group(1), batch=batch, more=more)
    if snap:
        text = text.replace(f'tables = ["{table}"]', f'tables = ["{table}", "{snap}"]\nsignal_table = "{table}_signal"')
    (app.root / "dbfanout.toml").write_text(text)
    engine = sa.create_engine(_with_app_name(PG_URL, "bench_writer"))
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, v TEXT, committed_at FLOAT)"
        )
        if snap:  # bench_snapshot.py's table: id, a short text, a number
            conn.exec_driver_sql(f"CREATE TABLE {snap} (id INTEGER PRIMARY KEY, v TEXT, n INTEGER)")
            conn.exec_driver_sql(
                f"INSERT INTO {snap} (id, v, n) SELECT g, 'customer-' || g, g"
                f" FROM generate_series(1, {snapshot_rows}) g"
            )
            conn.exec_driver_sql(f"ANALYZE {snap}")
    import tomllib

    config = parse_config(tomllib.loads(text), {"ORDERS_DB_URL": PG_URL}).pollers["orders"]
    for statement in setup_sql(config):  # the slot in a transaction of its own
        with engine.begin() as conn:
            conn.exec_driver_sql(statement)
    if config.wake == "notify":
        from dbfanout.ops.notify import create_notify_triggers

        create_notify_triggers(config)

    def cleanup() -> None:
        _drop_slot(engine, table)
        if url:  # the database of its own goes, with its slot
            engine.dispose()
            return
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP PUBLICATION IF EXISTS {table}")
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
            if snap:
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {snap}")
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}_signal")
        engine.dispose()

    return engine, (table, cleanup, snap)


def _poller_keys(args: argparse.Namespace) -> str:
    """The poller's keys the latency options set (lines of dbfanout.toml)."""
    more = f"linger_seconds = {args.linger}\npoll_interval_ms = {args.poll_ms}\n" if args.linger else ""
    if args.max_batches:
        more += f"max_batches_per_tick = {args.max_batches}\n"
    return more


def _pg_logical_setup(
    args: argparse.Namespace, tmp: Path, more: str
) -> tuple[AppDir, object, object, sa.Engine, Any, DbCost | None]:
    """``--db pg_logical``: the app, its servers, the writer's engine, the table (and its cleanup),
    and with ``--db-cost`` the database of its own that measures the poller's cost (dropped by
    the cleanup)."""
    from tests.support.databases import PG_URL

    cost = DbCost(PG_URL) if args.db_cost else None
    url = cost.url if cost else PG_URL
    app, azurite, emulator_cm = _prepare(tmp, batch=args.batch, source_url=_with_app_name(url, "bench_poller"))
    engine, logical = _pg_logical_source(
        app,
        more + (f'wake = "{args.wake}"\n' if args.wake != "poll" else ""),
        batch=args.batch,
        snapshot_rows=args.snapshot_rows,
        url=url if cost else None,
    )
    if cost is not None:
        table, cleanup, snap = logical

        def cleanup_all() -> None:
            cleanup()
            cost.drop()

        logical = (table, cleanup_all, snap)
    return app, azurite, emulator_cm, engine, logical, cost


def _start_writer(thread: threading.Thread, cost: DbCost | None) -> None:
    """Start the writer, and with ``--db-cost`` the window its cost is measured in."""
    if cost is not None:
        cost.start()
    thread.start()


def _cost_report(cost: DbCost | None, writer_txns: int) -> None:
    """With ``--db-cost``: end its window (every row handled) and print what the poller cost."""
    if cost is not None:
        cost.stop(txns=writer_txns)
        print(cost.report(), flush=True)


def latency(args: argparse.Namespace, tmp: Path) -> None:
    if args.snapshot_rows and args.db != "pg_logical":
        sys.exit("--snapshot-rows is for --db pg_logical")
    more = _poller_keys(args)
    schema = None
    logical: Any = None
    cost: DbCost | None = None
    if args.db == "pg_logical":
        app, azurite, emulator_cm, engine, logical, cost = _pg_logical_setup(args, tmp, more)
    elif args.db == "postgresql":
        from tests.host.app_support import drop_pg_schema, pg_schema_url
        from tests.support.databases import PG_URL, unique_name

        schema = unique_name("bench")
        source_url = pg_schema_url(PG_URL, schema)
        more += 'xid_column = "txid"\n'
        if args.wake == "notify":
            more += 'wake = "notify"\n'
    if logical is None:
        app, azurite, emulator_cm = _prepare(
            tmp, batch=args.batch, more=more, source_url=source_url if schema else None
        )
        engine = _create_pg_source(source_url) if schema else _create_source(app.root / "source.db")
    out = app.root / "latency.txt"
    os.environ["BENCH_OUT"] = str(out)
    table = logical[0] if logical else "orders"
    if schema and args.wake == "notify":
        from dbfanout.ops.notify import create_notify_triggers
        from shared.config import PollerConfig

        probe = PollerConfig(name="orders", source_url=source_url, cursor="version", pk=("id",), queue="q")
        create_notify_triggers(replace(probe, table="orders", wake="notify"))
    poll_ms = args.poll_ms if args.linger else "-"
    print(
        f"db={args.db} linger={args.linger or 'off'} poll_interval_ms={poll_ms} wake={args.wake} batch={args.batch}"
        + (f" max_batches={args.max_batches}" if args.max_batches else "")
        + (f" snapshot_rows={args.snapshot_rows}" if args.snapshot_rows else ""),
        flush=True,
    )
    host = HostProcess(app).start()
    stop = threading.Event()
    written = [0]

    def writer() -> None:
        per_txn = max(1, args.rate // args.txn_per_s)
        next_at = time.monotonic()
        while not stop.is_set():
            with engine.begin() as conn:
                base = written[0]
                now = time.time()
                conn.execute(
                    sa.text(f"INSERT INTO {table} (id, version, v, committed_at) VALUES (:i, :i, 'x', :t)"),
                    [{"i": base + k + 1, "t": now} for k in range(per_txn)],
                )
            written[0] += per_txn
            next_at += 1 / args.txn_per_s
            time.sleep(max(0.0, next_at - time.monotonic()))

    try:
        wait_for(host.started, 60, "the host to start")
        thread = threading.Thread(target=writer, daemon=True)
        began = time.time()
        _start_writer(thread, cost)
        time.sleep(args.seconds)
        snapshot = _snapshot(app, logical[2], args) if args.snapshot_rows else None
        stop.set()
        thread.join()
        wait_for(lambda: len(_lines(out)) >= written[0], 120, "every row to be handled")
        _cost_report(cost, written[0] // max(1, args.rate // args.txn_per_s))
        if snapshot is not None:
            _print_snapshot_latency(_rows(out), began, args, *snapshot)
            return
        values = _lines(out)
        steady = values[int(len(values) * args.warmup) :]
        print(f"rows={written[0]} rate={written[0] / args.seconds:.0f}/s handled={len(values)} measured={len(steady)}")
        print(f"latency s: {_figures(steady)}")
    finally:
        host.stop_quietly()
        emulator_cm.__exit__(None, None, None)  # type: ignore[attr-defined]
        azurite.stop()  # type: ignore[attr-defined]
        engine.dispose()
        if schema:
            drop_pg_schema(PG_URL, schema)
        if logical:
            logical[1]()


def _snapshot(app: AppDir, snap_table: str, args: argparse.Namespace) -> tuple[float, list[tuple[float, ...]]]:
    """The measured snapshot: ``dbfanout snapshot orders --table T`` (as a user queues one), then
    wait until the handler has seen every row of the table as a "read" event. Returns the
    request's time and the handler's (rows, time) lines of snapshot messages."""
    done = Path(os.environ["BENCH_OUT"] + ".snapshot")
    env = {k: v for k, v in os.environ.items() if k not in app.settings}  # local.settings.json decides
    requested = time.time()
    cmd = [sys.executable, "-m", "dbfanout.cli", "snapshot", "orders", "--table", snap_table]
    cmd += ["--config", str(app.root / "dbfanout.toml")]
    queued = subprocess.run(cmd, cwd=app.root, env=env, capture_output=True, text=True, timeout=120)
    if queued.returncode:
        raise RuntimeError(f"dbfanout snapshot failed: {queued.stdout}{queued.stderr}")

    def handled() -> bool:
        return sum(int(row[0]) for row in _rows(done)) >= int(args.snapshot_rows)

    wait_for(handled, args.snapshot_timeout, "every snapshot row to be handled")
    return requested, _rows(done)


def _print_snapshot_latency(
    values: list[tuple[float, ...]],
    began: float,
    args: argparse.Namespace,
    requested: float,
    reads: list[tuple[float, ...]],
) -> None:
    """Idle: the live rows committed after the warm-up and before the snapshot's request. During:
    those committed while snapshot rows reached the handler (its first to its last read event).
    Each split at the message's enqueued time: commit -> enqueued (the poller, its send) and
    enqueued -> handler (the worker, the messages ahead of it in the queue)."""
    first, last = min(row[1] for row in reads), max(row[1] for row in reads)
    rows = int(sum(row[0] for row in reads))
    idle_from = began + args.seconds * args.warmup
    idle = [row for row in values if idle_from <= row[0] < requested]
    during = [row for row in values if first <= row[0] <= last]
    duration = last - first
    print(f"rows={len(values)} rate={args.rate}/s handled={len(values)} idle={len(idle)} during={len(during)}")
    for label, phase in (("idle           ", idle), ("during snapshot", during)):
        print(f"{label} latency s: {_figures([row[1] for row in phase])}")
    if idle and during:
        idle_l, during_l = [row[1] for row in idle], [row[1] for row in during]
        ratios = " ".join(f"p{p}={_pct(during_l, p) / _pct(idle_l, p):.1f}x" for p in (50, 95, 99))
        print(f"during / idle: {ratios}")
    for label, phase in (("idle", idle), ("during", during)):
        poller = [row[2] - row[0] for row in phase if len(row) > 2 and row[2] == row[2]]  # not NaN
        worker = [row[0] + row[1] - row[2] for row in phase if len(row) > 2 and row[2] == row[2]]
        if poller:
            print(
                f"  {label}: commit -> enqueued p50={_pct(poller, 50):.3f} p95={_pct(poller, 95):.3f}, "
                f"enqueued -> handler p50={_pct(worker, 50):.3f} p95={_pct(worker, 95):.3f}"
            )
    print(
        f"snapshot: {rows:,} rows in {duration:.1f} s = {rows / duration if duration > 0 else 0:,.0f} rows/s "
        f"(first to last read event handled); {rows / (last - requested):,.0f} rows/s from the request "
        f"(dbfanout snapshot, {first - requested:.1f} s to the first row)"
    )


def _with_app_name(url: str, name: str) -> str:
    """``url`` with ``application_name`` set, so the server's views tell its sessions apart."""
    return sa.engine.make_url(url).update_query_dict({"application_name": name}).render_as_string(hide_password=False)


class DbCost:
    """The poller's cost on a local PostgreSQL server, in a database of its own (``--db-cost``).

    Samples every backend of each application name twice a second (``/proc/<pid>/stat``: CPU
    since the backend started, so one that appears mid-run counts from its start) and reads the
    database's transaction counters at both ends of the window: from the writer's start until
    every row was handled.
    """

    APPS = ("bench_poller", "bench_writer")

    def __init__(self, base_url: str) -> None:
        self.name = f"bench_cost_{uuid.uuid4().hex[:8]}"
        self._admin = sa.create_engine(base_url, isolation_level="AUTOCOMMIT")
        with self._admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {self.name}")
        self.url = sa.engine.make_url(base_url).set(database=self.name).render_as_string(hide_password=False)
        self._first: dict[int, float] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self._xacts = 0
        self._seconds = 0.0
        self._began = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _backends(self) -> list[tuple[int, str]]:
        with self._admin.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT pid, application_name FROM pg_stat_activity WHERE datname = :db"), {"db": self.name}
            )
            return [(int(r[0]), str(r[1])) for r in rows if r[1] in self.APPS]

    def _transactions(self) -> int:
        with self._admin.connect() as conn:
            row = conn.execute(
                sa.text("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = :db"),
                {"db": self.name},
            ).one()
            return int(row[0])

    def cpu_now(self) -> dict[int, tuple[str, float]]:
        """Each measured backend's application name and CPU seconds since it started, now."""
        return {pid: (app, _cpu_seconds(pid)) for pid, app in self._backends()}

    def _sample(self, first: bool = False) -> None:
        while True:
            for pid, app in self._backends():
                cpu = _cpu_seconds(pid)
                self._first.setdefault(pid, cpu if first else 0.0)
                self._last[pid] = (app, cpu)
            first = False
            if self._stop.wait(0.5):
                return

    def start(self) -> None:
        self._began = time.monotonic()
        self._xacts = self._transactions()
        for pid, app in self._backends():
            cpu = _cpu_seconds(pid)
            self._first[pid], self._last[pid] = cpu, (app, cpu)
        self._thread.start()

    def stop(self, txns: int) -> None:
        """End the window; ``txns``: the writer's transactions in it (subtracted from the count).

        A busy backend reports its counters to the database's only now and then (PostgreSQL 15:
        after 10 s idle, or when it exits), so the window ends by terminating the measured
        backends (the poller reconnects at its next tick) and reading the counters after they left.
        """
        self._stop.set()
        self._thread.join()
        self._seconds = time.monotonic() - self._began
        with self._admin.connect() as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                    " WHERE datname = :db AND application_name = ANY(:apps)"
                ),
                {"db": self.name, "apps": list(self.APPS)},
            )
        time.sleep(1.0)  # the stats of exited backends land in the shared counters
        self._xacts = self._transactions() - self._xacts - txns

    def report(self) -> str:
        cpu = dict.fromkeys(self.APPS, 0.0)
        for pid, (app, last) in self._last.items():
            cpu[app] += last - self._first.get(pid, 0.0)
        s = self._seconds
        return (
            f"db cost over {s:.0f} s: poller backends CPU {cpu['bench_poller'] / s * 1000:.1f} ms/s, "
            f"writer backends CPU {cpu['bench_writer'] / s * 1000:.1f} ms/s, "
            f"poller transactions {self._xacts / s:.1f}/s (database's less the writer's)"
        )

    def drop(self) -> None:
        with self._admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")
        self._admin.dispose()


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (``/proc/<pid>/stat``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


CATCHUP_HANDLER = '''
"""Benchmark handler: appends, per call, the number of events and the time."""
import os, threading, time
_lock = threading.Lock()
_path = os.environ["BENCH_OUT"]

def handle(events, context):
    line = f"{len(events)} {time.time():.6f}\\n"
    with _lock, open(_path, "a") as f:
        f.write(line)
'''


@dataclass
class CatchupResult:
    label: str
    rows: int
    elapsed: float  # host start -> last event handled
    drain: float  # first -> last handler call
    peak_rss: float
    rss_after_warmup: tuple[float, float]
    host_cpu: float
    emulator_cpu: float
    samples: list[tuple[float, int, float]]

    @property
    def rate(self) -> float:
        return self.rows / self.drain if self.drain > 0 else 0.0


def _write_source(path: Path, rows: int) -> None:
    engine = _create_source(path)
    with engine.begin() as conn:
        for start in range(0, rows, 50_000):
            stop = min(rows, start + 50_000)
            conn.execute(
                sa.text("INSERT INTO orders (id, version, v, committed_at) VALUES (:i, :i, :v, :t)"),
                [{"i": i + 1, "v": f"row-{i}", "t": time.time()} for i in range(start, stop)],
            )
    engine.dispose()


def _code_env(code: Path) -> dict[str, str]:
    """The environment of a child that runs ``code``'s packages (ahead of the editable install)."""
    return {**os.environ, "PYTHONPATH": str(code), "PYTHONUNBUFFERED": "1"}


def _python(profile: Path | None, name: str) -> list[str]:
    if profile is None:
        return [sys.executable]
    return [sys.executable, str(Path(__file__).with_name("profiled.py")), str(profile / name)]


def _start_emulator(
    code: Path, tmp: Path, queue: str, profile: Path | None, subscriptions: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[str], str]:
    """The emulator of ``code`` in its own process, with one queue as the catch-up needs it (with
    ``subscriptions``: a topic of that name with those subscriptions instead)."""
    config = tmp / "Config.json"
    props = {"RequiresDuplicateDetection": True, "LockDuration": "PT1M", "MaxSizeInMegabytes": 4096}
    namespace: dict[str, Any] = {"Name": "sbemulatorns", "Queues": [{"Name": queue, "Properties": props}]}
    if subscriptions:
        subs = [{"Name": s, "Properties": {"LockDuration": "PT1M"}} for s in subscriptions]
        topic = {"Name": queue, "Properties": {"RequiresDuplicateDetection": True, "MaxSizeInMegabytes": 4096}}
        namespace = {"Name": "sbemulatorns", "Topics": [{**topic, "Subscriptions": subs}]}
    config.write_text(json.dumps({"UserConfig": {"Namespaces": [namespace]}}))
    args = ["-m", "sbemulator", "servicebus", "--config", str(config), "--port", "0", "--http-port", "0"]
    proc = subprocess.Popen(
        [*_python(profile, "emulator"), *args], stdout=subprocess.PIPE, text=True, cwd=code, env=_code_env(code)
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"(Endpoint=sb://\S+)", line)
        if match:
            return proc, match.group(1)
    raise RuntimeError("the emulator did not print its connection string")


def _stop(proc: subprocess.Popen[Any], graceful: bool) -> None:
    if proc.poll() is not None:
        return
    if graceful:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.wait(10)


def _handled(path: Path) -> list[tuple[int, float]]:
    if not path.exists():
        return []
    pairs = (line.split() for line in path.read_text().splitlines())
    return [(int(n), float(t)) for n, t in pairs]


def _start_host(
    app: AppDir, code: Path, out: Path, profile: Path | None, otel_endpoint: str | None = None
) -> subprocess.Popen[bytes]:
    """``dbfanout run`` of ``code`` on the app folder (under the profiler with ``--profile``); with
    ``otel_endpoint``, the app exports its spans and metrics there over OTLP/HTTP."""
    env = {k: v for k, v in _code_env(code).items() if k not in app.settings}  # local.settings.json decides
    env["BENCH_OUT"] = str(out)
    if otel_endpoint:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otel_endpoint
    cmd = [*_python(profile, "host"), "-m", "dbfanout.cli", "run", "--app-root", str(app.root)]
    with (app.root / "host.log").open("ab") as log:
        return subprocess.Popen(cmd, cwd=app.root, env=env, stdout=log, stderr=subprocess.STDOUT)


def catchup_once(
    label: str, code: Path, source: Path, tmp: Path, storage: str, args: argparse.Namespace
) -> CatchupResult:
    """One catch-up of the source by ``code``'s host and emulator, this harness around them."""
    tmp.mkdir(parents=True)
    profile: Path | None = args.profile / label if args.profile else None
    if profile:
        profile.mkdir(parents=True, exist_ok=True)
    queue = "bench-" + uuid.uuid4().hex[:10]
    emulator, connection = _start_emulator(code, tmp, queue, profile)
    host: subprocess.Popen[bytes] | None = None
    try:
        app = AppDir.create(
            tmp / "app", queue=queue, storage=storage, servicebus=connection, source_url=f"sqlite:///{source}"
        )
        for name in ("function_app.py", "host.json"):  # the contestant's own app files
            shutil.copy(code / name, app.root / name)
        (app.root / "bench_handler.py").write_text(CATCHUP_HANDLER)
        config = CONFIG.format(name=app.app_name, queue=queue, batch=args.batch, max_batches=args.max_batches, more="")
        (app.root / "dbfanout.toml").write_text(config)
        out = app.root / "handled.txt"
        started = time.time()
        host = _start_host(app, code, out, profile, args.otel_endpoint if label == "traced" else None)
        samples: list[tuple[float, int, float]] = []
        handled = 0
        while handled < args.rows:
            if host.poll() is not None:
                raise RuntimeError(f"the host exited: {(app.root / 'host.log').read_text()[-3000:]}")
            handled = sum(n for n, _ in _handled(out))
            samples.append((time.time() - started, handled, _rss_mb(host.pid)))
            if time.time() - started > args.timeout:
                raise TimeoutError(f"the catch-up did not finish: {handled} of {args.rows} handled")
            time.sleep(0.5)
        host_cpu, emulator_cpu = _cpu_seconds(host.pid), _cpu_seconds(emulator.pid)
        calls = _handled(out)
        first, last = calls[0][1], max(t for _, t in calls)
        rss = [s[2] for s in samples if s[0] > 5.0] or [s[2] for s in samples]
        return CatchupResult(
            label=label,
            rows=sum(n for n, _ in calls),
            elapsed=last - started,
            drain=last - first,
            peak_rss=max(s[2] for s in samples),
            rss_after_warmup=(min(rss), max(rss)),
            host_cpu=host_cpu,
            emulator_cpu=emulator_cpu,
            samples=samples,
        )
    finally:
        if host is not None:  # a traced host stops gracefully: it flushes its spans and metrics to the sink
            _stop(host, graceful=profile is not None or label == "traced")
        _stop(emulator, graceful=profile is not None)


def _print_result(r: CatchupResult) -> None:
    print(
        f"{r.label:<9} {r.rows:>9,} {r.rate:>10,.0f} {r.rows / r.elapsed:>10,.0f} {r.peak_rss:>9.1f}"
        f" {r.rss_after_warmup[0]:>7.1f}-{r.rss_after_warmup[1]:<7.1f}"
        f" {r.host_cpu / r.rows * 1e6:>11.1f} {r.emulator_cpu / r.rows * 1e6:>10.1f}",
        flush=True,
    )


def catchup(args: argparse.Namespace, tmp: Path) -> None:
    contestants = [("after", ROOT)]
    if args.baseline:
        contestants.append(("before", args.baseline.resolve()))
    sink = None
    args.otel_endpoint = None
    if args.otel:  # tracing off ("after") and on ("traced"), same code, interleaved
        from otlp_sink import OtlpSink  # beside this script

        sink = OtlpSink().__enter__()
        args.otel_endpoint = sink.endpoint
        contestants.append(("traced", ROOT))
    source = tmp / "source.db"
    _write_source(source, args.rows)
    azurite = start_azurite()
    results: dict[str, list[CatchupResult]] = {label: [] for label, _ in contestants}
    print(f"rows={args.rows} batch={args.batch} repeat={args.repeat} load={os.getloadavg()[0]:.2f}")
    header = (
        f"{'code':<9} {'rows':>9} {'rows/s':>10} {'incl.start':>10} {'peak RSS':>9} {'RSS after 5 s':>15}"
        f" {'host µs/row':>11} {'emu µs/row':>10}"
    )
    print(header)
    try:
        for round_ in range(args.repeat):
            order = contestants if round_ % 2 == 0 else contestants[::-1]
            for label, code in order:
                run_dir = tmp / f"{label}-{round_}"
                results[label].append(catchup_once(label, code, source, run_dir, azurite.connection_string, args))
                _print_result(results[label][-1])
        print("best of each (rows/s: first to last handler call; incl.start: from the host's start; MB; CPU):")
        print(header)
        for label, _ in contestants:
            _print_result(max(results[label], key=lambda r: r.rate))
        if args.verbose:
            for label, _ in contestants:
                samples = results[label][0].samples
                for t, n, rss in samples[:: max(1, len(samples) // 12)]:
                    print(f"  {label} t={t:6.1f}s handled={n:>9} rss={rss:7.1f} MB")
    finally:
        azurite.stop()
        if sink is not None:
            print(f"telemetry requests received from the traced hosts: {sink.received}")
            sink.__exit__()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="mode", required=True)
    lat = sub.add_parser("latency")
    lat.add_argument("--rate", type=int, default=1000, help="rows per second")
    lat.add_argument("--seconds", type=float, default=60.0)
    lat.add_argument("--warmup", type=float, default=0.1, help="fraction of the first events not measured")
    lat.add_argument("--linger", type=float, default=0.0, help="the poller's linger_seconds (0: off)")
    lat.add_argument("--poll-ms", type=int, default=50, help="the poller's poll_interval_ms when lingering")
    lat.add_argument(
        "--db", choices=("sqlite", "postgresql", "pg_logical"), default="sqlite", help="postgresql: xid_column"
    )
    lat.add_argument(
        "--wake",
        choices=("poll", "notify", "wal"),
        default="poll",
        help="notify: PostgreSQL; wal: pg_logical; with --linger",
    )
    lat.add_argument("--txn-per-s", type=int, default=20, help="the writer's transactions a second")
    lat.add_argument("--db-cost", action="store_true", help="pg_logical: the poller's CPU and queries on the server")
    lat.add_argument("--batch", type=int, default=500, help="the poller's batch_size")
    lat.add_argument("--max-batches", type=int, default=0, help="max_batches_per_tick (0: the poller's default)")
    lat.add_argument(
        "--snapshot-rows",
        type=int,
        default=0,
        help="pg_logical: after --seconds idle, snapshot a second table of this many rows (dbfanout snapshot) "
        "and measure the live rows' latency while it runs",
    )
    lat.add_argument("--snapshot-timeout", type=float, default=1800.0)
    cat = sub.add_parser("catchup")
    cat.add_argument("--rows", type=int, default=200_000, help="1000000 for the headline")
    cat.add_argument("--batch", type=int, default=1000, help="the poller's batch_size")
    cat.add_argument(
        "--max-batches",
        type=int,
        default=200,
        help="max_batches_per_tick (with the 1 s schedule, batch x this caps rows/s; 20 was the old value)",
    )
    cat.add_argument("--repeat", type=int, default=1, help="rounds; contestants alternate their order")
    cat.add_argument("--baseline", type=Path, help="another checkout (git worktree add DIR COMMIT), run alike")
    cat.add_argument(
        "--otel",
        action="store_true",
        help="also run this checkout with tracing and metrics exported over OTLP/HTTP to a local sink (label traced)",
    )
    cat.add_argument("--profile", type=Path, help="write host.txt and emulator.txt (CPU profiles) per contestant here")
    cat.add_argument("--verbose", action="store_true", help="print the RSS samples of the first round")
    cat.add_argument("--timeout", type=float, default=3600.0)
    cat.add_argument("--keep", action="store_true", help="keep the app folders (host.log, handled.txt)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    try:
        latency(args, tmp) if args.mode == "latency" else catchup(args, tmp)
    finally:
        if getattr(args, "keep", False):
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()


def _drop_slot(engine: sa.Engine, slot: str, timeout: float = 30.0) -> None:
    """Drop a replication slot, ending the session that still holds it (a host's last peek may
    outlive the host's stop by a moment: "replication slot ... is active for PID")."""
    deadline = time.monotonic() + timeout
    while True:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
                    " WHERE slot_name = :s AND active_pid IS NOT NULL"
                ),
                {"s": slot},
            )
        try:
            with engine.begin() as conn:
                conn.execute(
                    sa.text(
                        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = :s"
                    ),
                    {"s": slot},
                )
            return
        except sa.exc.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # the terminated session is still ending
