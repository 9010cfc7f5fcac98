"""kind = "mysql_binlog": catch-up beside the keyset poller on the same MariaDB, and commit → handler
latency with linger (issue 30). Run by hand; prints one line per figure.

    .venv/bin/python benchmarks/bench_mysql_binlog.py catchup [--changes 1000000] [--txn 1000] [--batch 1000]
                                                              [--repeat N] [--baseline /tmp/base-checkout]
    .venv/bin/python benchmarks/bench_mysql_binlog.py latency [--seconds 20] [--rate 200] [--linger 1 --poll-ms 50]

The server: DBFANOUT_TEST_MYSQL_BINLOG_URL when set (its binlog must be on, ROW, FULL), else a
private ``mariadbd`` started for the run (tests/support/private_mariadb.py) and removed after.

catchup : the changes (inserts, then updates of a fifth of the rows and hard deletes of a tenth, in
          transactions of --txn) are written after the binlog poller's starting point; then, each in a
          child process of its own (peak RSS is the child's ``ru_maxrss``):
          binlog  - run_tick() until caught up: stream → decode → batch → a sink that builds every
                    event → CAS commit on the in-memory state store;
          keyset  - the same over a table holding as many rows (cursor ``version``, indexed), the
                    keyset poller on the same server; the table is filled before the binlog
                    poller's starting point, so neither poller reads the other's rows.
          rows/s = rows delivered / seconds; rows per CPU second counts the poller process's CPU
          (start-up included) and the private server's (the keyset's queries run there): steadier
          than wall time on a busy machine. --baseline runs another checkout's children in turn
          with this one's, on the same rows (before/after figures at the same load).
latency : the real ``function_app.py`` under ``dbfanout run`` (Azurite, the emulator), a writer
          committing --rate rows/s in 20 transactions a second, each row stamped with its commit
          time; the handler records handler time minus commit time (benchmarks/bench_latency.py's
          handler). The poller runs every second, lingering --linger s polling every --poll-ms.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import sqlalchemy as sa  # noqa: E402

from poller.state.memory import MemoryStateStore  # noqa: E402
from poller.tick.lifecycle import run_tick  # noqa: E402
from shared.config import PollerConfig, parse_config  # noqa: E402
from shared.models import Batch, Checkpoint  # noqa: E402


class EventSink:
    def send(self, batch: Batch) -> None:
        for _ in batch.events:  # builds every event, as a sink that encodes them would
            pass

    def close(self) -> None:
        pass


def _server() -> tuple[str, Any]:
    from tests.support.private_mariadb import binlog_reason, start_private_mariadb

    url = os.environ.get("DBFANOUT_TEST_MYSQL_BINLOG_URL")
    if url and binlog_reason(url) is None:
        return url, None
    server = start_private_mariadb()
    return server.url, server


def _server_cpu(server: Any) -> float:
    """CPU seconds the private server has used (0 for a server of DBFANOUT_TEST_MYSQL_BINLOG_URL).

    Beside rows/s, rows per CPU second (poller and server) is the cost on a machine whose other
    load makes wall time vary run to run."""
    if server is None:
        return 0.0
    fields = Path(f"/proc/{server.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _binlog_config(url: str, table: str, batch: int, **more: Any) -> PollerConfig:
    raw = {"kind": "mysql_binlog", "source_url": url, "tables": [table], "queue": "q", "batch_size": batch,
           "max_batches_per_tick": 100, "max_uncommitted_batches": 16, **more}  # fmt: skip
    return parse_config({"app": {"name": "b"}, "pollers": {"p": raw}}, {}).pollers["p"]


def _keyset_config(url: str, table: str, batch: int) -> PollerConfig:
    raw = {"source_url": url, "table": table, "cursor": "version", "pk": ["id"], "queue": "q", "batch_size": batch,
           "max_batches_per_tick": 100, "settle_seconds": 0}  # fmt: skip
    return parse_config({"app": {"name": "b"}, "pollers": {"p": raw}}, {}).pollers["p"]


def _plan(changes: int) -> tuple[int, int, int]:
    """(inserts, updates, deletes) of about ``changes`` changes."""
    inserts = changes * 100 // 130
    return inserts, inserts // 5, inserts // 10


def _write_changes(engine: sa.Engine, table: str, changes: int, txn: int) -> int:
    inserts, updates, deletes = _plan(changes)
    for start in range(0, inserts, txn):
        rows = [{"id": i, "v": f"customer-{i}", "n": i} for i in range(start, min(start + txn, inserts))]
        with engine.begin() as conn:
            conn.execute(sa.text(f"INSERT INTO {table} (id, version, v, n) VALUES (:id, :id, :v, :n)"), rows)
    for start in range(0, updates, txn):
        with engine.begin() as conn:
            conn.execute(sa.text(f"UPDATE {table} SET n = n + 1 WHERE id >= :a AND id < :b"),
                         {"a": start, "b": min(start + txn, updates)})  # fmt: skip
    for start in range(0, deletes, txn):
        with engine.begin() as conn:
            conn.execute(sa.text(f"DELETE FROM {table} WHERE id >= :a AND id < :b"),
                         {"a": inserts - min(start + txn, deletes), "b": inserts - start})  # fmt: skip
    return inserts + updates + deletes


def _fill(engine: sa.Engine, table: str, rows: int, txn: int) -> None:
    for start in range(0, rows, txn):
        batch = [{"id": i, "v": f"customer-{i}", "n": i} for i in range(start, min(start + txn, rows))]
        with engine.begin() as conn:
            conn.execute(sa.text(f"INSERT INTO {table} (id, version, v, n) VALUES (:id, :id, :v, :n)"), batch)


def child(kind: str, url: str, table: str, batch: int, start: str | None) -> None:
    """One catch-up in this process: prints {rows, seconds, rss_mb} as JSON."""
    from shared.codec import decode_position

    if kind == "binlog":
        from poller.sources.mysql_binlog.source import MysqlBinlogSource

        cfg = _binlog_config(url, table, batch)
        source: Any = MysqlBinlogSource(cfg)
    else:
        from poller.sources.keyset.source import SqlSource

        cfg = _keyset_config(url, table, batch)
        source = SqlSource(cfg)
    store = MemoryStateStore("p")
    if start is not None:  # the binlog poller's starting point, taken before the changes were written
        snap = store.try_acquire("seed", dt.timedelta(seconds=60), source.fingerprint)
        assert snap is not None
        snap = store.commit(snap, Checkpoint(position=decode_position(json.loads(start))))
        store.release(snap)
    delivered = 0

    class Counting(EventSink):
        def send(self, b: Batch) -> None:
            nonlocal delivered
            super().send(b)
            delivered += len(b.events)

    began = time.perf_counter()
    while True:
        result = run_tick(cfg, source, store, Counting(), owner_id="bench")
        if result.stop_reason == "caught_up":
            break
    seconds = time.perf_counter() - began
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rows": delivered, "seconds": seconds, "rss_mb": rss}))


def _run_child(kind: str, url: str, table: str, batch: int, start: str | None, script: Path) -> dict[str, Any]:
    """One catch-up by ``script`` (this file, or a baseline checkout's) in a child process; its
    CPU seconds (start-up included) from the children's resource usage."""
    args = [sys.executable, str(script), "--child", kind, "--url", url, "--table", table, "--batch", str(batch)]
    if start is not None:
        args += ["--start", start]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["cpu"] = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return result


def catchup(args: argparse.Namespace) -> None:
    from poller.sources.mysql_binlog.source import MysqlBinlogSource
    from shared.codec import encode_position
    from tests.support.databases import unique_name

    url, server = _server()
    engine = sa.create_engine(url)
    binlog_table, keyset_table = unique_name("bbl"), unique_name("bks")
    try:
        with engine.begin() as conn:
            for t in (binlog_table, keyset_table):
                conn.execute(sa.text(f"CREATE TABLE {t} (id INT PRIMARY KEY, version BIGINT NOT NULL, v VARCHAR(40),"
                                     f" n INT, KEY ix_{t} (version, id))"))  # fmt: skip
        # The keyset table is filled before the binlog poller's starting point: each poller then
        # reads only its own rows (the binlog stream is not also carrying the keyset table's inserts).
        began = time.perf_counter()
        count = sum(_plan(args.changes))
        _fill(engine, keyset_table, count, args.txn)  # as many rows as the binlog has changes
        source = MysqlBinlogSource(_binlog_config(url, binlog_table, args.batch))
        first = source.fetch(None, 1).advance
        source.close()
        assert first is not None
        start = json.dumps(encode_position(first))
        changes = _write_changes(engine, binlog_table, args.changes, args.txn)
        assert changes == count
        print(f"wrote {changes} changes and {changes} keyset rows in {time.perf_counter() - began:.0f} s", flush=True)
        print(f"load before: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
        scripts = [("", Path(__file__))]
        if args.baseline:  # interleaved with this checkout's, on the same rows and the same load
            scripts.insert(0, ("baseline ", Path(args.baseline) / "benchmarks" / "bench_mysql_binlog.py"))
        for _ in range(args.repeat):
            for label, script in scripts:
                for kind, table in (("binlog", binlog_table), ("keyset", keyset_table)):
                    server_before = _server_cpu(server)
                    r = _run_child(kind, url, table, args.batch, start if kind == "binlog" else None, script)
                    served = _server_cpu(server) - server_before  # the keyset's queries run there
                    print(f"{label}{kind:7} rows={r['rows']} {r['rows'] / r['seconds']:,.0f} rows/s peak RSS "
                          f"{r['rss_mb']:.0f} MB | {r['rows'] / (r['cpu'] + served):,.0f} rows per CPU second (poller "
                          f"{r['cpu']:.2f} s with its start-up, server {served:.2f} s) | load {os.getloadavg()[0]:.2f}",
                          flush=True)  # fmt: skip
        print(f"load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {binlog_table}, {keyset_table}"))
        engine.dispose()
        if server is not None:
            server.stop()


def latency(args: argparse.Namespace, tmp: Path) -> None:
    from bench_latency import HANDLER, _figures, _lines

    from poller.state.blob import open_state_store
    from sbemulator.testing import running_emulator, unique_queue
    from shared.settings import StorageConnection
    from tests.host.app_support import AppDir, HostProcess, wait_for
    from tests.support.azurite import start_azurite
    from tests.support.databases import unique_name

    url, server = _server()
    engine = sa.create_engine(url)
    table = unique_name("blat")
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {table} (id INT PRIMARY KEY, version INT, v TEXT, committed_at DOUBLE)"))
    azurite = start_azurite()
    with running_emulator() as emulator:
        queue = unique_queue(emulator, "bench", requires_duplicate_detection=True, lock_duration="PT60S")
        app = AppDir.create(tmp / "app", queue=queue, storage=azurite.connection_string,
                            servicebus=emulator.connection_string, source_url=url)  # fmt: skip
        (app.root / "bench_handler.py").write_text(HANDLER)
        linger = f"linger_seconds = {args.linger}\npoll_interval_ms = {args.poll_ms}\n" if args.linger else ""
        (app.root / "dbfanout.toml").write_text(
            f'[app]\nname = "{app.app_name}"\n\n[pollers.orders]\nkind = "mysql_binlog"\n'
            f'source_url = "${{ORDERS_DB_URL}}"\ntables = ["{table}"]\nqueue = "{queue}"\n'
            f'schedule = "*/1 * * * * *"\nbatch_size = 500\nlease_ttl_seconds = 60\n'
            f'handler = "bench_handler:handle"\n{linger}'
        )
        out = app.root / "latency.txt"
        os.environ["BENCH_OUT"] = str(out)
        store = open_state_store(StorageConnection(connection_string=azurite.connection_string), "db-state",
                                 app.app_name, "orders")  # fmt: skip
        host = HostProcess(app).start()
        stop, written = threading.Event(), [0]

        def writer() -> None:
            per_txn, next_at = max(1, args.rate // 20), time.monotonic()
            while not stop.is_set():
                with engine.begin() as conn:
                    base, now = written[0], time.time()
                    insert = f"INSERT INTO {table} (id, version, v, committed_at) VALUES (:i, :i, 'x', :t)"
                    conn.execute(sa.text(insert), [{"i": base + k + 1, "t": now} for k in range(per_txn)])
                written[0] += per_txn
                next_at += 0.05
                time.sleep(max(0.0, next_at - time.monotonic()))

        try:
            wait_for(host.started, 60, "the host to start")

            def checkpointed() -> bool:
                snap = store.load()
                return snap is not None and snap.doc.checkpoint.position is not None

            wait_for(checkpointed, 60, "the poller's starting point")
            thread = threading.Thread(target=writer, daemon=True)
            thread.start()
            time.sleep(args.seconds)  # the measured period (a duration, not a wait for a condition)
            stop.set()
            thread.join()
            wait_for(lambda: len(_lines(out)) >= written[0], 120, "every row to be handled")
            values = _lines(out)
            steady = values[int(len(values) * 0.2) :]
            print(f"db=mysql_binlog linger={args.linger or 'off'} poll_ms={args.poll_ms if args.linger else '-'} "
                  f"rows={written[0]} rate={written[0] / args.seconds:.0f}/s measured={len(steady)}")  # fmt: skip
            print(f"latency s: {_figures(steady)}")
            print(f"load: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        finally:
            host.stop_quietly()
            azurite.stop()
            with engine.begin() as conn:
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {table}"))
            engine.dispose()
            if server is not None:
                server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=["catchup", "latency"], default="catchup")
    parser.add_argument("--changes", type=int, default=200_000)
    parser.add_argument("--txn", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--baseline", help="a checkout (git worktree) whose catch-up runs interleaved with this one's")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--linger", type=float, default=1.0)
    parser.add_argument("--poll-ms", type=int, default=50)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--table", help=argparse.SUPPRESS)
    parser.add_argument("--start", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.url, args.table, args.batch, args.start)
    elif args.what == "catchup":
        catchup(args)
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            latency(args, Path(tmp))


if __name__ == "__main__":
    main()
