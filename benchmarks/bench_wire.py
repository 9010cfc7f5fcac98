"""The keyset poller's wire path vs. the DBAPI read floor (issue 31). Run by hand; prints one table.

    .venv/bin/python benchmarks/bench_wire.py                          # 100k rows, SQLite + PostgreSQL
    .venv/bin/python benchmarks/bench_wire.py --baseline /tmp/base     # another checkout's wire path too
    .venv/bin/python benchmarks/bench_wire.py --profile /tmp/wire-prof # + one profiled wire run per database

floor  : the driver's own cursor paging the poller's keyset SELECT (the statement ``SqlSource``
         plans, compiled once): ``sqlite3`` / ``psycopg`` ``execute`` + ``fetchall`` per page, rows
         kept as the driver's tuples, no SQLAlchemy in the loop. The denominator.
wire   : THE HEADLINE. ``run_tick()`` until caught up with the real Service Bus sink
         (``ServiceBusSink``, a ``QueueSink``: packing, event and message ids) on the project's
         ``QueueSender`` and the official azure-servicebus SDK, sending to the project's emulator
         (sbemulator, ``running_emulator`` as the tests start it, in its own process: on Azure the
         broker is another machine, and in-process it would take the poller's GIL), state on Azurite.
         Its queue requires duplicate detection, as the deployed queues do. The sender's link is
         opened before the clock starts (a deployed poller reuses it from tick to tick); each run
         has a fresh emulator, queue and poller name, and checks that the emulator holds every
         message the sink sent, and the messages every row.
packed : the same catch-up with the real packing and a sender that discards the messages
         (bench_poller's headline): wire - packed is the send's own cost.
ratio  : best against best over the rounds; median: the median of each round's contestant ÷ floor,
         the measures of a round run back to back (the steadier figure on a shared machine).
CPU    : µs a row of the catch-up, medians over the rounds: the poller's process (every thread,
         ``time.process_time``) and the emulator's (``/proc/<pid>/stat``, from before the child
         starts to its end: its share of the wire path; on Azure the broker is not ours).

``wire``, ``packed`` and ``baseline`` run in child processes (same harness, fresh interpreter).
--baseline DIR also runs DIR's wire path (``git worktree add /tmp/base <commit>``), interleaved.
--rtt-ms N adds N ms after every message the wire contestants send (the wait releases the GIL,
as a socket wait does): a broker a network round trip away, which the local emulator is not.
--profile DIR writes, after the timed rounds, one extra wire run per database under profilers:
``DIR/<db>-poller.txt`` and ``DIR/<db>-emulator.txt`` (benchmarks/profiled.py: CPU per thread and
per function, the poller and the emulator apart), so the emulator's share is read separately.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

# DBFANOUT_BENCH_CODE: measure another checkout's code with this harness (see --baseline).
sys.path.insert(0, os.environ.get("DBFANOUT_BENCH_CODE") or str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import sqlalchemy as sa
from bench_poller import DEPTH, build_table, drop_table, poller_config

from poller.sources.keyset.resolve import RAW_CURSOR as _RAW_CURSOR
from poller.sources.keyset.source import SqlSource
from poller.state.blob import open_state_store
from poller.tick.lifecycle import run_tick
from shared.config import PollerConfig
from shared.messages import OutgoingMessage
from shared.models import Position
from shared.settings import StorageConnection
from tests.support.azurite import start_azurite
from tests.support.databases import PG_URL, unreachable_reason

HERE = Path(__file__).resolve().parents[1]
Measure = tuple[int, float]


# ------------------------------------------------------------------------------------ the floor


def _compiled(engine: sa.Engine, stmt: sa.Select[Any]) -> tuple[str, Callable[[dict[str, Any]], Any]]:
    """The statement's SQL for the driver and a function from bind values to the driver's parameters."""
    compiled = stmt.compile(dialect=engine.dialect)
    if compiled.positional:
        order = compiled.positiontup or []
        return str(compiled), lambda bind: tuple(compiled.construct_params(bind)[name] for name in order)
    return str(compiled), lambda bind: compiled.construct_params(bind)


def _driver_connection(url: str) -> Any:
    parsed = sa.engine.make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return sqlite3.connect(parsed.database or ":memory:")
    import psycopg

    return psycopg.connect(parsed.set(drivername="postgresql").render_as_string(hide_password=False))


def floor_scan(cfg: PollerConfig) -> Measure:
    """Page through with the poller's own keyset SELECT on the driver's cursor (rows as tuples)."""
    source = SqlSource(cfg)
    first = source.keyset_query(None, cfg.batch_size)
    after = source.keyset_query(Position(cursor=_probe_cursor(cfg), pk={"id": -1}), cfg.batch_size)
    assert first is not None and after is not None
    engine = sa.create_engine(cfg.source_url)
    (first_sql, first_params), (after_sql, after_params) = _compiled(engine, first[0]), _compiled(engine, after[0])
    conn = _driver_connection(cfg.source_url)
    try:
        cur = conn.cursor()
        total, started = 0, time.perf_counter()
        cur.execute(first_sql, first_params(first[1]))
        names = [d[0] for d in cur.description]  # the SELECT is "*, cursor AS raw cursor" on SQLite
        cursor_at = names.index(_RAW_CURSOR if _RAW_CURSOR in names else cfg.cursor)
        id_at = names.index("id")
        while rows := cur.fetchall():
            total += len(rows)
            last = rows[-1]
            cur.execute(
                after_sql, after_params({"dbf_limit": cfg.batch_size, "k0": last[cursor_at], "k1": last[id_at]})
            )
        elapsed = time.perf_counter() - started
        conn.rollback()
    finally:
        conn.close()
        engine.dispose()
        source.close()
    return total, elapsed


def _probe_cursor(cfg: PollerConfig) -> Any:
    """A cursor value of the right type, to obtain the 'after' statement once."""
    engine = sa.create_engine(cfg.source_url)
    with engine.connect() as conn:
        assert cfg.table is not None
        value = conn.execute(sa.select(sa.func.min(sa.column(cfg.cursor))).select_from(sa.table(cfg.table))).scalar()
    engine.dispose()
    return value


# ------------------------------------------------------------------------ the emulator's process


def emulator_child() -> None:
    """The emulator as the tests start it, in this process; one queue as a deployed poller's.

    Prints ``READY <connection string> <queue>``; each ``stats`` line on stdin prints the queue's
    counts as JSON; end of input stops it (a profiled run writes its report then)."""
    from sbemulator.testing import running_emulator, unique_queue

    with running_emulator() as emulator:
        queue = unique_queue(
            emulator, "wire", requires_duplicate_detection=True, max_size_bytes=4 * 1024**3, lock_duration="PT60S"
        )
        print("READY", emulator.connection_string, queue, flush=True)
        for line in sys.stdin:
            if line.strip() == "stats":
                print(json.dumps(emulator.queue_stats(queue)), flush=True)


def _python(profile: Path | None, module_args: list[str]) -> list[str]:
    """This script as a module (``profiled.py`` takes ``-m``), under the profiler with ``profile``."""
    if profile is None:
        return [sys.executable, "-m", "bench_wire", *module_args]
    return [
        sys.executable,
        str(Path(__file__).with_name("profiled.py")),
        str(profile),
        "-m",
        "bench_wire",
        *module_args,
    ]


def _child_env(code: Path) -> dict[str, str]:
    path = os.pathsep.join([str(Path(__file__).resolve().parent), str(code)])
    return {**os.environ, "DBFANOUT_BENCH_CODE": str(code), "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


class EmulatorProcess:
    """One fresh emulator in its own process (this checkout's code) for one wire run."""

    def __init__(self, profile: Path | None = None) -> None:
        self.proc = subprocess.Popen(
            _python(profile, ["--emulator"]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_child_env(HERE),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "READY":
            self.stop()
            raise RuntimeError(f"the emulator did not start (it printed {line!r}); run it alone to see why")
        self.connection, self.queue = line[1], line[2]

    def stats(self) -> dict[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        result: dict[str, int] = json.loads(self.proc.stdout.readline())
        return result

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# ----------------------------------------------------------------------------- the poller's side


class CountingSender:
    """The real sender; counts what it was given, to check the emulator got all of it. With
    ``rtt`` (seconds) each message also waits that long after it was accepted: a broker one
    network round trip further away (the wait releases the GIL, as a socket wait does)."""

    def __init__(self, sender: Any, rtt: float = 0.0) -> None:
        self._sender = sender
        self._rtt = rtt
        self.messages = 0
        self.events = 0

    def send_all(self, messages: Sequence[OutgoingMessage]) -> None:
        self._sender.send_all(messages)
        if self._rtt:
            time.sleep(self._rtt * len(messages))  # a simulated network, not a wait for a condition
        self.messages += len(messages)
        self.events += sum(len(m.event_ids) for m in messages)

    def close(self) -> None:
        self._sender.close()


class _Discard:
    """A sender that accepts every message and drops it (packing without the network)."""

    def __init__(self) -> None:
        self.events = 0

    def send_all(self, messages: Sequence[OutgoingMessage]) -> None:
        self.events += sum(len(m.event_ids) for m in messages)

    def close(self) -> None:
        pass


def _catch_up(cfg: PollerConfig, storage: str, sink: Any) -> tuple[float, float]:
    """Seconds of the catch-up, wall and this process's CPU (every thread)."""
    store = open_state_store(StorageConnection(connection_string=storage), "bench-state", "bench", cfg.name)
    source = SqlSource(cfg)
    source.fetch(None, 1)  # untimed warm-up: engine, reflection, first connection
    started, cpu = time.perf_counter(), time.process_time()
    while run_tick(cfg, source, store, sink, owner_id="bench").stop_reason != "caught_up":
        pass
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    source.close()
    return elapsed, cpu


def wire_child(spec: str) -> None:
    """One catch-up of ``spec``'s table (this process's code); prints rows, seconds, messages."""
    from azure.servicebus import ServiceBusClient

    from poller.sinks.queue import QueueSink
    from poller.sinks.servicebus import ServiceBusSink
    from shared.servicebus import QueueSender

    s = json.loads(spec)
    cfg = replace(poller_config(s["url"], s["table"], s["batch"]), name=s["name"], max_uncommitted_batches=s["depth"])
    if s["kind"] == "packed":
        discard = _Discard()
        elapsed, cpu = _catch_up(cfg, s["storage"], QueueSink(cfg, discard, limit=cfg.max_message_bytes))
        print(json.dumps([discard.events, elapsed, 0, cpu]))
        return
    client = ServiceBusClient.from_connection_string(s["connection"])
    sender = CountingSender(QueueSender(client, s["queue"]), s["rtt"])
    # The link opens on the first send (about a second); a deployed poller reuses it across ticks.
    sender.send_all([OutgoingMessage(message_id=f"warm-{uuid.uuid4()}", body=b"{}", subject="warm-up", event_ids=())])
    elapsed, cpu = _catch_up(cfg, s["storage"], ServiceBusSink(cfg, sender))  # type: ignore[arg-type]
    sender.close()
    client.close()
    print(json.dumps([sender.events, elapsed, sender.messages, cpu]))


#: --rtt-ms: a simulated round trip added to every message the wire contestants send
RTT_SECONDS = 0.0

#: (code, kind) -> per run: CPU µs a row of the poller's catch-up (every thread) and of the emulator's process
CPU_PER_ROW: dict[tuple[Path, str], list[tuple[float, float]]] = {}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def in_child(code: Path, kind: str, cfg: PollerConfig, storage: str, profile: Path | None = None) -> Measure:
    """A ``kind`` ("wire" or "packed") catch-up by ``code``'s modules in a child process."""
    emulator = (
        EmulatorProcess(profile.with_name(profile.name + "-emulator") if profile else None) if kind == "wire" else None
    )
    try:
        spec = {
            "kind": kind,
            "url": cfg.source_url,
            "table": cfg.table,
            "batch": cfg.batch_size,
            "name": cfg.name,
            "depth": cfg.max_uncommitted_batches,
            "storage": storage,
            "connection": emulator.connection if emulator else None,
            "queue": emulator.queue if emulator else None,
            "rtt": RTT_SECONDS,
        }
        args = _python(profile.with_name(profile.name + "-poller") if profile else None, ["--child", json.dumps(spec)])
        emulator_cpu = _cpu_seconds(emulator.proc.pid) if emulator else 0.0
        out = subprocess.run(args, env=_child_env(code), check=False, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"the {kind} run of {code} failed:\n{out.stderr[-3000:]}")
        emulator_cpu = _cpu_seconds(emulator.proc.pid) - emulator_cpu if emulator else 0.0
        rows, elapsed, messages, cpu = json.loads(out.stdout.splitlines()[-1])
        CPU_PER_ROW.setdefault((code, kind), []).append((cpu / rows * 1e6, emulator_cpu / rows * 1e6))
        if emulator is not None:
            held = emulator.stats()["active"]
            if held != messages:  # the warm-up message included on both sides
                raise RuntimeError(f"the emulator holds {held} messages; the sender was given {messages}")
        return rows, elapsed
    finally:
        if emulator is not None:
            emulator.stop()


# ----------------------------------------------------------------------------------------- rounds


def best_rates(runs: int, measures: dict[str, Callable[[], Measure]]) -> tuple[dict[str, float], dict[str, float]]:
    """Best rows/s of each measure over ``runs`` interleaved rounds, and the median over the rounds
    of each measure's ratio to the first one's (measured back to back in the round)."""
    best = {name: 0.0 for name in measures}
    first = next(iter(measures))
    ratios: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(runs):
        rates: dict[str, float] = {}
        for name, measure in measures.items():
            rows, elapsed = measure()
            rates[name] = rows / elapsed
            best[name] = max(best[name], rates[name])
        for name in measures:
            ratios[name].append(rates[name] / rates[first])
    return best, {name: statistics.median(values) for name, values in ratios.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--depth", type=int, default=DEPTH, help="max_uncommitted_batches")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--no-packed", action="store_true", help="leave out the packed (discarding) contestant")
    parser.add_argument("--baseline", type=Path, help="another checkout: its wire path as a contestant too")
    parser.add_argument("--profile", type=Path, help="one profiled wire run per database: poller and emulator reports")
    parser.add_argument(
        "--rtt-ms",
        type=float,
        default=0.0,
        help="add this wait to every message the wire contestants send (a broker a network round trip away)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--emulator", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.emulator:
        emulator_child()
        return
    if args.child:
        wire_child(args.child)
        return

    global RTT_SECONDS
    RTT_SECONDS = args.rtt_ms / 1000
    azurite = start_azurite()
    tmp = Path(tempfile.mkdtemp(prefix="dbfanout-wire-"))
    targets = [("sqlite-file", f"sqlite:///{tmp / 'bench.db'}")]
    if not args.no_postgres and unreachable_reason(PG_URL) is None:
        targets.append(("postgresql", PG_URL))
    print(
        f"rows={args.rows}  batch={args.batch}  max_uncommitted_batches={args.depth}  best of {args.repeat}"
        f"  rtt={args.rtt_ms:g} ms"
        f"  python={sys.version.split()[0]}  loadavg at start: {_loadavg()}"
    )
    names = ["wire"] + ([] if args.no_packed else ["packed"]) + (["baseline"] if args.baseline else [])
    print(
        f"{'database':<12} {'floor rows/s':>12}"
        + "".join(f" {n + ' rows/s':>16} {'ratio':>6} {'median':>6}" for n in names)
    )
    runs = iter(range(1_000_000))
    built: list[tuple[str, str]] = []
    try:
        for label, url in targets:
            table = build_table(url, args.rows)
            built.append((url, table))
            cfg = replace(poller_config(url, table, args.batch), max_uncommitted_batches=args.depth)

            def fresh(cfg: PollerConfig = cfg) -> PollerConfig:
                return replace(cfg, name=f"{cfg.name}-{next(runs)}")  # each run catches up from scratch

            def checked(result: Measure) -> Measure:
                if result[0] != args.rows:
                    raise RuntimeError(f"a run delivered {result[0]} rows of {args.rows}")
                return result

            floor_scan(cfg)  # warm-up: page cache, untimed
            measures: dict[str, Callable[[], Measure]] = {
                "floor": partial(lambda c: checked(floor_scan(c)), cfg),
                "wire": lambda: checked(in_child(HERE, "wire", fresh(), azurite.connection_string)),
            }
            if not args.no_packed:
                measures["packed"] = lambda: checked(in_child(HERE, "packed", fresh(), azurite.connection_string))
            if args.baseline:
                base: Path = args.baseline.resolve()
                measures["baseline"] = partial(
                    lambda b: checked(in_child(b, "wire", fresh(), azurite.connection_string)), base
                )
            best, medians = best_rates(args.repeat, measures)
            print(
                f"{label:<12} {best['floor']:>12,.0f}"
                + "".join(f" {best[n]:>16,.0f} {best[n] / best['floor']:>6.2f} {medians[n]:>6.2f}" for n in names)
                + f"   loadavg {_loadavg()}",
                flush=True,
            )
            print_cpu()
            if args.profile:
                args.profile.mkdir(parents=True, exist_ok=True)
                in_child(HERE, "wire", fresh(), azurite.connection_string, profile=args.profile / label)
                print(f"profiles: {args.profile / label}-poller.txt, {args.profile / label}-emulator.txt")
    finally:
        azurite.stop()
        for url, table in built:
            drop_table(url, table)


def print_cpu() -> None:
    """The CPU of the rounds just run, a row: the poller's process and the emulator's apart."""
    for (code, kind), runs in sorted(CPU_PER_ROW.items(), key=lambda item: str(item[0])):
        poller_cpu = statistics.median(c for c, _ in runs)
        emulator_cpu = statistics.median(e for _, e in runs)
        who = "baseline " if code != HERE else ""
        print(
            f"{'':<12} CPU µs a row, median of {len(runs)}: {who}{kind}: poller {poller_cpu:.2f}"
            + (f", emulator {emulator_cpu:.2f}" if kind == "wire" else "")
        )
    CPU_PER_ROW.clear()


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    main()
