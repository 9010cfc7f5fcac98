"""Capacity: the load curve of one deployment (issue 31; run by hand).

    python benchmarks/bench_capacity.py [--source keyset,pg_logical,outbox,mysql_binlog]
                                        [--target queue,topic]
                                        [--linger 0,1] [--schedule-seconds 1] [--cardinality one,many]
                                        [--rates 500,1000,2000,5000,10000,20000]
                                        [--rows-per-commit 1,10] [--step-seconds 30] [--json]
                                        [--writer threads|pgbench|threads,pgbench] [--writers 8]
                                        [--pgbench-jobs 1] [--pgbench PATH]
                                        [--db-url URL] [--pg-url URL] [--mysql-url URL]

For each configuration (source x target x linger) it starts the project's Service Bus emulator in
a process of its own (Azurite once for the run), a database of its own on the PostgreSQL server
(``--db-url`` for keyset and outbox, ``--pg-url`` with wal_level = logical for pg_logical), or on
the MariaDB server for mysql_binlog (``--mysql-url``; a private ``mariadbd`` with the row-based
binlog on when that server has it off: benchmarks/capacity_binlog.py) and the real
``function_app.py`` under ``dbfanout run``. Writer threads in this process (``--writers``,
each on a connection of its own, each a share of the rate) then offer each rate (changes a second,
in commits of ``--rows-per-commit`` rows) for ``--step-seconds``, every row stamped with its
write time (keyset, pg_logical and mysql_binlog: a column; outbox: the payload).
``--writer pgbench`` (pg_logical and keyset) offers the rate with PostgreSQL's pgbench instead
(``--writers`` clients on ``--pgbench-jobs`` threads, ``-R`` the rate over the commit size: one
INSERT of ``--rows-per-commit`` rows a transaction, the same columns and the same write time,
read once per commit from the server's clock; benchmarks/capacity_pgbench.py): Python threads
cost this process most of a core at 15,000 rows/s on two cores, pgbench a fraction of that. The
rows written are counted in the database; a step that falls behind ends pgbench early.
``--writer threads,pgbench`` runs one curve of each on the same deployment, interleaved step by
step (configuration ``.../pgbench`` for pgbench's). The handler
(bench_latency's) records, per event, that time, its latency and the message's enqueued time; on
a topic two subscriptions each run it into a file of their own.

Per step: the rate offered and written (the writer may fall short: then the database or this
process is the limit), the rate delivered (events handled per second in the step's window after
its first fifth, the slower subscription on a topic), commit -> handler p50/p95/p99 (rows written
in that window, once every row was handled), that latency split at the enqueued time (commit ->
enqueued: the poller's read, pack and send; enqueued -> handler: the worker's receive, decode,
handler and the queue ahead of it), CPU seconds a second of the host process, the emulator
process and the poller's and the writer's database backends (``/proc``: the server must run on
this machine; a backend that exits within a step loses its share; MariaDB: the whole server
process, column dbsrv, as its connections are threads of one process; pgbench's backends are the
writer's), this process's (the writer threads, column writer; with pgbench, this process plus the
pgbench process), the cores busy on the whole machine (``/proc/stat``, column box: 2.0 is
a saturated 2-core box) and the load average.

A step stops early when the backlog (rows written, not yet handled) passes ``--backlog-seconds``
of the offered rate: the deployment does not keep up, and the higher rates of that sequence are
skipped. Per configuration and commit size: "sustained" is the highest rate whose p99 <= 1 s
(``--p99-bound``; without linger the 1 s schedule alone puts p99 near 1 s), delivered >= 90 % of
written, not stopped early; the "knee" is the first step where the
delivered rate falls below 90 % of the written, the step stopped early, or p99 at least doubled
(and passed 0.5 s). A step whose writer fell more than 10 % short of the offered rate is marked
and never counts as sustained (the writer, not the deployment, was the limit). Everything runs on
loopback and is bounded in time (``--drain-seconds``). The delivered rate counts whole ticks in a
window of 4/5 of the step: with the 1 s schedule a 10 s step reads it to about +-12 %, a 30 s
step to about +-4 %, so a smoke run's knee is noise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from bench_latency import (
    CONFIG,
    HANDLER,
    ROOT,
    DbCost,
    _cpu_seconds,
    _create_pg_source,
    _pct,
    _pg_logical_source,
    _poller_keys,
    _start_emulator,
    _stop,
    _with_app_name,
)
from capacity_binlog import BINLOG_CONFIG, MariaDbCost, binlog_table, checkpointed
from capacity_pgbench import PgbenchWriter, find_pgbench

from tests.host.app_support import AppDir, HostProcess, _subscription_tables, wait_for
from tests.support.azurite import start_azurite
from tests.support.databases import MYSQL_URL, PG_URL

LOGICAL_URL = "postgresql+psycopg://postgres@127.0.0.1:5433/test"
SUBSCRIPTIONS = ("first", "second")
SECOND_HANDLER = HANDLER.replace('os.environ["BENCH_OUT"]', 'os.environ["BENCH_OUT"] + ".second"')


class HandledFile:
    """The lines a handler appended so far, read incrementally: (commit, latency, enqueued)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[tuple[float, float, float]] = []
        self._offset = 0

    def read(self) -> int:
        if self.path.exists():
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
            whole = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next read
            self._offset += len(whole)
            for line in whole.decode().splitlines():
                commit, latency, enqueued = (float(x) for x in line.split())
                self.rows.append((commit, latency, enqueued))
        return len(self.rows)


@dataclass
class Step:
    config: str
    rows_per_commit: int
    offered: int
    seconds: float = 0.0
    written: float = 0.0  # rows/s the writer managed
    delivered: float = 0.0  # events/s handled (the slower subscription)
    p50: float = float("nan")
    p95: float = float("nan")
    p99: float = float("nan")
    poller_p50: float = float("nan")  # commit -> enqueued
    poller_p99: float = float("nan")
    worker_p50: float = float("nan")  # enqueued -> handler
    worker_p99: float = float("nan")
    host_cpu: float = 0.0  # CPU seconds a second
    emulator_cpu: float = 0.0
    db_poller_cpu: float = 0.0
    db_writer_cpu: float = 0.0
    db_server_cpu: float = 0.0  # mysql_binlog: the whole MariaDB server process
    writer_cpu: float = 0.0  # this process: the writer threads (and the handler files' readers)
    box_busy: float = 0.0  # cores busy on the whole machine (/proc/stat), of os.cpu_count()
    load: float = 0.0
    stopped_early: bool = False
    drained: bool = True
    missing: int = 0  # rows written and not handled when the drain timed out
    writer: str = "threads"  # what offered the rate: writer threads in this process, or pgbench

    @property
    def writer_short(self) -> bool:
        """The writer did not reach the offered rate: the database or this process limited the step."""
        return self.written < 0.9 * self.offered


@dataclass
class Deployment:
    """One configuration running: its host, emulator, database, writer and handler files."""

    name: str
    host: HostProcess
    emulator: Any
    cost: DbCost | MariaDbCost
    write: Callable[[sa.Connection, int, int, float], None]  # (conn, first id, rows, time)
    engine: sa.Engine
    files: list[HandledFile]
    cleanup: Callable[[], None] = lambda: None
    pgbench: PgbenchWriter | None = None  # --writer pgbench: writes the same table
    written: int = 0  # rows committed
    _next_id: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def commit(self, conn: sa.Connection, rows: int) -> None:
        """Write and commit ``rows`` rows of ids no other writer thread takes."""
        with self._lock:
            first, self._next_id = self._next_id, self._next_id + rows
        with conn.begin():
            self.write(conn, first, rows, time.time())
        with self._lock:
            self.written += rows

    def handled(self) -> int:
        return min(f.read() for f in self.files)

    def cpu(self) -> tuple[float, float, dict[int, tuple[str, float]]]:
        assert self.host.proc is not None
        return _cpu_seconds(self.host.proc.pid), _cpu_seconds(self.emulator.pid), self.cost.cpu_now()


def _insert_rows(table: str) -> Callable[[sa.Connection, int, int, float], None]:
    insert = sa.text(f"INSERT INTO {table} (id, version, v, committed_at) VALUES (:i, :i, 'x', :t)")

    def write(conn: sa.Connection, first: int, rows: int, now: float) -> None:
        conn.execute(insert, [{"i": first + k, "t": now} for k in range(rows)])

    return write


def _outbox_rows(table: str) -> Callable[[sa.Connection, int, int, float], None]:
    from shared.outbox import write_change

    def write(conn: sa.Connection, first: int, rows: int, now: float) -> None:
        for i in range(first, first + rows):
            write_change(conn, table, aggregate=i, type="insert", payload={"id": i, "committed_at": now})

    return write


def _as_topic(text: str, topic: str) -> str:
    """A queue poller's dbfanout.toml made a topic poller with two subscriptions, each its handler."""
    text = text.replace(f'queue = "{topic}"', f'topic = "{topic}"')
    text = text.replace('handler = "bench_handler:handle"\n', "")
    handlers = {"first": "bench_handler:handle", "second": "bench_handler_second:handle"}
    return text + "\n" + _subscription_tables({name: {"handler": h} for name, h in handlers.items()})


def deploy(
    source: str, target: str, linger: float, args: argparse.Namespace, tmp: Path, storage: str, cardinality: str = "one"
) -> Deployment:
    """Start one configuration: its database, emulator, app folder and host (running, warmed up)."""
    with contextlib.ExitStack() as undo:  # what is started is stopped again if a later part fails
        deployment = _deploy(source, target, linger, args, tmp, storage, undo, cardinality)
        deployment.cleanup = undo.pop_all().close
        return deployment


def _deploy(
    source: str,
    target: str,
    linger: float,
    args: argparse.Namespace,
    tmp: Path,
    storage: str,
    undo: contextlib.ExitStack,
    cardinality: str = "one",
) -> Deployment:
    name = f"{source}/{target}/linger={linger:g}" if linger else f"{source}/{target}/linger=off"
    name += "/many" if cardinality == "many" else ""
    pgbench_table = ""  # the table a pgbench writer can write (pg_logical, keyset)
    entity = "cap-" + os.urandom(5).hex()
    tmp.mkdir(parents=True)
    binlog = source == "mysql_binlog"
    pg_url = args.pg_url if source == "pg_logical" else args.db_url
    cost = MariaDbCost(args.mysql_url, undo) if binlog else DbCost(pg_url)
    undo.callback(cost.drop)
    subs = SUBSCRIPTIONS if target == "topic" else ()
    emulator, connection = _start_emulator(ROOT, tmp, entity, None, subs)
    undo.callback(_stop, emulator, False)
    app = AppDir.create(
        tmp / "app",
        queue=entity,
        storage=storage,
        servicebus=connection,
        source_url=cost.url if binlog else _with_app_name(cost.url, "bench_poller"),
    )
    (app.root / "bench_handler.py").write_text(HANDLER)
    (app.root / "bench_handler_second.py").write_text(SECOND_HANDLER)
    keys = argparse.Namespace(linger=linger, poll_ms=args.poll_ms, max_batches=0)  # CONFIG sets max_batches
    more = _poller_keys(keys) + (f'cardinality = "{cardinality}"\n' if cardinality != "one" else "")
    config = CONFIG.format(name=app.app_name, queue=entity, batch=args.batch, max_batches=args.max_batches, more=more)
    (app.root / "dbfanout.toml").write_text(config)
    if source == "pg_logical":
        more += f"max_batches_per_tick = {args.max_batches}\n"
        engine, (table, drop_slot, _) = _pg_logical_source(app, more, batch=args.batch, url=cost.url)
        undo.callback(drop_slot)
        write = _insert_rows(table)
        pgbench_table = table
    elif binlog:
        engine, write = binlog_table(cost.url), _insert_rows("orders")
        binlog_keys = dict(name=app.app_name, table="orders", queue=entity, batch=args.batch, more=more)
        (app.root / "dbfanout.toml").write_text(BINLOG_CONFIG.format(max_batches=args.max_batches, **binlog_keys))
    elif source == "keyset":
        # The transaction id is the cursor (exact, docs/cursors.md): writer threads take ids in
        # another order than they commit, which a cursor on the id would skip past.
        engine = _create_pg_source(cost.url)
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE INDEX ix_orders_txid ON orders (txid, id)")
        engine.dispose()
        keyset = config.replace('cursor = "version"\n', 'cursor = "txid"\nxid_column = "txid"\n')
        (app.root / "dbfanout.toml").write_text(keyset)
        engine, write = sa.create_engine(_with_app_name(cost.url, "bench_writer")), _insert_rows("orders")
        pgbench_table = "orders"
    else:
        from shared.outbox import create_outbox

        engine = sa.create_engine(_with_app_name(cost.url, "bench_writer"))
        with engine.begin() as conn:
            create_outbox(conn, "bench_outbox")
        keyset_keys = 'table = "orders"\ncursor = "version"\npk = ["id"]\n'
        outbox_keys = 'kind = "outbox"\ntable = "bench_outbox"\n'
        (app.root / "dbfanout.toml").write_text(config.replace(keyset_keys, outbox_keys))
        write = _outbox_rows("bench_outbox")
    undo.callback(engine.dispose)
    toml = app.root / "dbfanout.toml"
    if subs:
        toml.write_text(_as_topic(toml.read_text(), entity))
    if args.schedule_seconds != 1:
        every = f'schedule = "*/{args.schedule_seconds} * * * * *"'
        toml.write_text(toml.read_text().replace('schedule = "*/1 * * * * *"', every))
        name += f"/every={args.schedule_seconds}s"
    out = app.root / "handled.txt"
    os.environ["BENCH_OUT"] = str(out)
    files = [HandledFile(out)] + ([HandledFile(Path(f"{out}.second"))] if subs else [])
    host = HostProcess(app).start()
    undo.callback(host.stop_quietly)
    deployment = Deployment(name, host, emulator, cost, write, engine, files)
    if "pgbench" in args.writer and pgbench_table:
        (tmp / "pgbench").mkdir()
        deployment.pgbench = PgbenchWriter(args.pgbench, cost.url, pgbench_table, tmp / "pgbench")
        undo.callback(deployment.pgbench.close)
    try:
        wait_for(host.started, 90, "the host to start")
        if binlog:  # rows committed before the poller's starting point in the binlog are never read
            wait_for(checkpointed(storage, app.app_name), 90, "the poller's starting point")
        with engine.connect() as conn:  # warm-up: connections, the first tick, the first message
            deployment.commit(conn, 20)
        wait_for(lambda: deployment.handled() >= 20, args.drain_seconds, "the warm-up rows to be handled")
    except TimeoutError:
        print(host.log_tail(30), file=sys.stderr)
        raise
    return deployment


def _writer(d: Deployment, rate: int, per_commit: int, until: float, abort: threading.Event) -> None:
    """Commit ``per_commit`` rows at a time, ``rate`` rows a second on average, until ``until``."""
    interval = per_commit / rate
    next_at = time.monotonic()
    with d.engine.connect() as conn:
        while not abort.is_set() and time.time() < until:
            d.commit(conn, per_commit)
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))


def _box_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (every core; not idle, not iowait), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass
class _Mark:
    """The counters a step's figures are differences of, read at one moment."""

    at: float
    host: float
    emulator: float
    db: dict[int, tuple[str, float]]
    own: float  # this process's CPU seconds
    box: float

    @classmethod
    def now(cls, d: Deployment) -> _Mark:
        host, emulator, db = d.cpu()
        return cls(time.time(), host, emulator, db, time.process_time(), _box_busy_seconds())


def _offer_threads(d: Deployment, rate: int, per_commit: int, args: argparse.Namespace, step: Step) -> float:
    """Writer threads in this process offer the step's rows; returns the writer's CPU outside this process (none)."""
    abort = threading.Event()
    share = (d, rate / args.writers, per_commit, time.time() + args.step_seconds, abort)
    threads = [threading.Thread(target=_writer, args=share) for _ in range(args.writers)]
    for thread in threads:
        thread.start()
    bound = max(500, rate * args.backlog_seconds)
    for thread in threads:
        while thread.is_alive():
            thread.join(0.5)
            if d.written - d.handled() > bound and not abort.is_set():
                abort.set()
                step.stopped_early = True
    return 0.0


def _offer_pgbench(
    d: Deployment, rate: int, per_commit: int, args: argparse.Namespace, step: Step
) -> tuple[_Mark, float]:
    """pgbench offers the step's rows until the step's end or the backlog bound; returns the
    counters at that moment (pgbench's backends still there) and pgbench's CPU seconds."""
    pg = d.pgbench
    assert pg is not None
    until = time.time() + args.step_seconds
    pg.start(d._next_id, rate, per_commit, args.writers, args.pgbench_jobs, args.step_seconds)
    bound = max(500, rate * args.backlog_seconds)
    try:
        while (left := until - time.time()) > 0:
            time.sleep(min(0.5, left))
            failure = pg.failed()
            if failure:
                raise RuntimeError(failure)
            if d.written + pg.issued() - d.handled() > bound:  # issued: an upper bound of written
                step.stopped_early = True
                break
        return _Mark.now(d), pg.cpu()
    finally:
        written, d._next_id = pg.stop()
        d.written += written


def run_step(d: Deployment, rate: int, per_commit: int, args: argparse.Namespace, writer: str = "threads") -> Step:
    """Offer ``rate`` rows a second for a step (``writer``: threads or pgbench) and measure it."""
    step = Step(d.name + ("/pgbench" if writer == "pgbench" else ""), per_commit, rate, writer=writer)
    start = _Mark.now(d)
    before = d.written
    if writer == "pgbench":
        end, outside = _offer_pgbench(d, rate, per_commit, args, step)
    else:
        outside = _offer_threads(d, rate, per_commit, args, step)
        end = _Mark.now(d)
    written = d.written - before
    try:
        wait_for(lambda: d.handled() >= d.written, args.drain_seconds, "the step's rows to be handled", 0.5)
    except TimeoutError:
        step.drained = False
        step.missing = d.written - d.handled()
    _figures(step, d, start, end, written)
    step.writer_cpu += outside / step.seconds
    return step


def _figures(step: Step, d: Deployment, start: _Mark, end: _Mark, written: int) -> None:
    """The step's rates, latencies and CPU from the handled rows and the counters at its ends."""
    began, ended = start.at, end.at
    span = ended - began
    step.seconds, step.written, step.load = span, written / span, os.getloadavg()[0]
    warm = began + span / 5
    window = [f.rows for f in d.files]
    step.delivered = min(sum(1 for c, lat, _ in rows if warm <= c + lat <= ended) for rows in window) / (ended - warm)
    measured = [row for rows in window for row in rows if warm <= row[0] <= ended]
    if measured:
        latencies = [lat for _, lat, _ in measured]
        step.p50, step.p95, step.p99 = (_pct(latencies, p) for p in (50, 95, 99))
        timed = [(c, lat, e) for c, lat, e in measured if e == e]  # NaN: no enqueued time
        if timed:
            poller = [e - c for c, _, e in timed]
            worker = [c + lat - e for c, lat, e in timed]
            step.poller_p50, step.poller_p99 = _pct(poller, 50), _pct(poller, 99)
            step.worker_p50, step.worker_p99 = _pct(worker, 50), _pct(worker, 99)
    step.host_cpu, step.emulator_cpu = (end.host - start.host) / span, (end.emulator - start.emulator) / span
    step.writer_cpu, step.box_busy = (end.own - start.own) / span, (end.box - start.box) / span
    for pid, (app, cpu) in end.db.items():
        used = (cpu - start.db.get(pid, (app, 0.0))[1]) / span
        if app == "bench_poller":
            step.db_poller_cpu += used
        elif app == "server":
            step.db_server_cpu += used
        else:
            step.db_writer_cpu += used


def _knee(steps: list[Step]) -> Step | None:
    previous: Step | None = None
    for s in steps:
        jumped = previous is not None and s.p99 >= 2 * previous.p99 and s.p99 > 0.5
        if s.stopped_early or not s.drained or s.delivered < 0.9 * s.written or jumped:
            return s
        previous = s
    return None


def _sustained(steps: list[Step], p99_bound: float) -> Step | None:
    ok = [
        s
        for s in steps
        if s.p99 <= p99_bound
        and not (s.stopped_early or s.writer_short or not s.drained)
        and s.delivered >= 0.9 * s.written
    ]
    return max(ok, key=lambda s: s.offered, default=None)


HEADER = (
    f"{'configuration':<38} {'rows/commit':>11} {'offered':>8} {'written':>8} {'delivered':>9}"
    f" {'p50':>6} {'p95':>6} {'p99':>6} {'poll p50/p99':>13} {'work p50/p99':>13}"
    f" {'host':>5} {'emu':>5} {'dbpoll':>6} {'dbwrite':>7} {'dbsrv':>5} {'writer':>6} {'box':>5} {'load':>5}  note"
)


def _row(s: Step) -> str:
    notes = [
        ("stopped early (backlog)", s.stopped_early),
        (f"not drained ({s.missing} rows not handled)", not s.drained),
        ("writer short of the offered rate", s.writer_short),
    ]
    note = ", ".join(text for text, on in notes if on)
    return (
        f"{s.config:<38} {s.rows_per_commit:>11} {s.offered:>8} {s.written:>8.0f} {s.delivered:>9.0f}"
        f" {s.p50:>6.3f} {s.p95:>6.3f} {s.p99:>6.3f} {s.poller_p50:>6.3f}/{s.poller_p99:<6.3f}"
        f" {s.worker_p50:>6.3f}/{s.worker_p99:<6.3f} {s.host_cpu:>5.3f} {s.emulator_cpu:>5.3f}"
        f" {s.db_poller_cpu:>6.3f} {s.db_writer_cpu:>7.3f} {s.db_server_cpu:>5.3f} {s.writer_cpu:>6.3f}"
        f" {s.box_busy:>5.2f} {s.load:>5.2f}  {note}"
    )


def _summary(steps: list[Step], p99_bound: float) -> list[dict[str, Any]]:
    out = []
    for key in dict.fromkeys((s.config, s.rows_per_commit) for s in steps):
        curve = [s for s in steps if (s.config, s.rows_per_commit) == key]
        sustained, knee = _sustained(curve, p99_bound), _knee(curve)
        writer = next((s for s in curve if s.writer_short), None)
        out.append(
            {
                "configuration": key[0],
                "rows_per_commit": key[1],
                "sustained": sustained.offered if sustained else None,
                "knee": knee.offered if knee else None,
                "writer_short_from": writer.offered if writer else None,
            }
        )
    return out


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _words(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _check_writers(args: argparse.Namespace) -> None:
    """Exit on a --writer/--writers combination the run cannot do; find pgbench."""
    if "threads" in args.writer and not 1 <= args.writers <= 15:
        sys.exit("--writers: 1 to 15 (the writer engine's connection pool)")
    if "pgbench" not in args.writer:
        return
    if not 1 <= args.writers <= 64 or args.pgbench_jobs < 1:
        sys.exit("--writers with pgbench: 1 to 64 clients; --pgbench-jobs: at least 1")
    if set(args.source) - {"pg_logical", "keyset"}:
        sys.exit("--writer pgbench: --source pg_logical and keyset only (their table: id, version, v, committed_at)")
    args.pgbench = args.pgbench or find_pgbench()
    if not args.pgbench:
        sys.exit("--writer pgbench: no pgbench found (install PostgreSQL's client programs or pass --pgbench PATH)")


def _curves(d: Deployment, per_commit: int, args: argparse.Namespace, steps: list[Step]) -> bool:
    """One load curve per --writer at this commit size, their steps interleaved rate by rate; a
    curve ends at a step that fell behind. False when a step left a backlog (not drained)."""
    ended: set[str] = set()
    for rate in (int(r) for r in args.rates):
        for writer in (w for w in args.writer if w not in ended):
            steps.append(run_step(d, rate, per_commit, args, writer))
            print(_row(steps[-1]), file=sys.stderr, flush=True)
            if not steps[-1].drained:
                return False
            if steps[-1].stopped_early:
                ended.add(writer)  # higher rates would not keep up either
        if ended >= set(args.writer):
            break
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--source",
        type=_words,
        default=["keyset", "pg_logical", "outbox"],
        help="comma list: keyset,pg_logical,outbox,mysql_binlog",
    )
    parser.add_argument("--target", type=_words, default=["queue", "topic"], help="comma list: queue,topic (two subs)")
    parser.add_argument(
        "--cardinality", type=_words, default=["one"], help="comma list: one,many (the worker's trigger)"
    )
    parser.add_argument("--linger", type=_floats, default=[0.0, 1.0], help="comma list of linger_seconds (0: off)")
    parser.add_argument("--poll-ms", type=int, default=50, help="poll_interval_ms when lingering")
    parser.add_argument(
        "--schedule-seconds",
        type=int,
        default=1,
        help="the timer every N seconds (a divisor of 60; give --linger N-0.5 to linger through it)",
    )
    parser.add_argument(
        "--rates", type=_floats, default=[500, 1000, 2000, 5000, 10000, 20000], help="comma list (rows/s)"
    )
    parser.add_argument("--rows-per-commit", type=_floats, default=[1, 10], help="comma list: one curve each")
    parser.add_argument("--step-seconds", type=float, default=30.0)
    parser.add_argument(
        "--writers", type=int, default=1, help="writer threads (connections) or pgbench clients, each a rate share"
    )
    parser.add_argument(
        "--writer",
        type=_words,
        default=["threads"],
        help="comma list: threads (in this process), pgbench (pg_logical, keyset); both: one curve each, interleaved",
    )
    parser.add_argument("--pgbench-jobs", type=int, default=1, help="pgbench's threads (-j) for its --writers clients")
    parser.add_argument("--pgbench", default=None, help="pgbench (default: PostgreSQL's bindir's, the PATH's)")
    parser.add_argument("--backlog-seconds", type=float, default=5.0, help="stop a step past this many seconds' rows")
    parser.add_argument("--p99-bound", type=float, default=1.0, help="sustained: p99 at most this (s)")
    parser.add_argument("--drain-seconds", type=float, default=60.0, help="wait for a step's rows at most this long")
    parser.add_argument("--batch", type=int, default=500, help="batch_size")
    parser.add_argument("--max-batches", type=int, default=200, help="max_batches_per_tick")
    parser.add_argument("--db-url", default=PG_URL, help="PostgreSQL for keyset and outbox (a database of its own)")
    parser.add_argument("--pg-url", default=LOGICAL_URL, help="PostgreSQL with wal_level = logical for pg_logical")
    parser.add_argument(
        "--mysql-url", default=MYSQL_URL, help="MariaDB for mysql_binlog (a private one when its binlog is off)"
    )
    parser.add_argument("--json", action="store_true", help="print the steps and the summary as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the app folders (host.log, handled.txt)")
    args = parser.parse_args()
    unknown = (
        set(args.source) - {"keyset", "pg_logical", "outbox", "mysql_binlog"}
        | set(args.target) - {"queue", "topic"}
        | set(args.cardinality) - {"one", "many"}
    )
    unknown |= set(args.writer) - {"threads", "pgbench"}
    if unknown or not args.writer:
        sys.exit(f"unknown --source/--target/--cardinality/--writer values: {sorted(unknown)}")
    _check_writers(args)
    if args.schedule_seconds < 1 or 60 % args.schedule_seconds:
        sys.exit(f"--schedule-seconds {args.schedule_seconds}: give a divisor of 60 (1, 2, 3, 5, 10, ...)")
    tmp = Path(tempfile.mkdtemp(prefix="bench-capacity-"))
    azurite = start_azurite()
    steps: list[Step] = []
    log = sys.stderr
    print(f"load={os.getloadavg()[0]:.2f} cores={os.cpu_count()} step={args.step_seconds:g}s", file=log, flush=True)
    print(HEADER, file=log, flush=True)
    try:
        for n, (source, target, linger, cardinality) in enumerate(
            (s, t, g, c) for s in args.source for t in args.target for g in args.linger for c in args.cardinality
        ):
            d = deploy(source, target, linger, args, tmp / str(n), azurite.connection_string, cardinality)
            try:
                for per_commit in (int(r) for r in args.rows_per_commit):
                    if not _curves(d, per_commit, args, steps):
                        break  # a backlog left: the next curve would measure it
            finally:
                d.cleanup()
    finally:
        azurite.stop()
        if args.keep:
            print(f"kept {tmp}", file=log)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    summary = _summary(steps, args.p99_bound)
    if args.json:
        rows = [{k: None if v != v else v for k, v in asdict(s).items()} for s in steps]  # NaN: no samples
        print(json.dumps({"steps": rows, "summary": summary}, indent=2))
        return
    print(f"load average {os.getloadavg()}, {os.cpu_count()} cores; latency in s, CPU in s/s, rates in rows/s")
    print(HEADER)
    for s in steps:
        print(_row(s))
    for entry in summary:
        print(
            f"{entry['configuration']:<38} rows/commit={entry['rows_per_commit']:<3}"
            f" sustained (p99 <= {args.p99_bound:g} s): {entry['sustained'] or 'none'}"
            f"  knee: {entry['knee'] or 'not reached'}"
            + (f"  (the writer fell short from {entry['writer_short_from']})" if entry["writer_short_from"] else "")
        )


if __name__ == "__main__":
    main()
