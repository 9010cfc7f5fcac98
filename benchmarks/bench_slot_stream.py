"""Issue 41: a slot streamed (START_REPLICATION) against the peek loop. Run by hand; prints tables.

    .venv/bin/python benchmarks/bench_slot_stream.py                       # 200k changes, live 2k/8k per s
    .venv/bin/python benchmarks/bench_slot_stream.py --changes 50000 --live 0

Starts a private wal_level=logical PostgreSQL (tests/support/private_postgres.py), writes one
backlog (--changes inserts in transactions of --txn rows, a table like bench_capacity's) behind a
pgoutput slot, then for each measure copies that slot (pg_copy_logical_replication_slot: the same
position) and reads the copy to the end, interleaved, best of --repeat:

peek all raw  : one peek of the whole backlog (bench_pg_logical's "raw peek": no loop, the ceiling)
peek raw      : the poller's peek loop: pg_logical_slot_peek_binary_changes of --peek-messages
                messages (peek.py's statement, streamed by peek.stream), then
                pg_replication_slot_advance to the last Commit read, until every change is read
stream raw    : START_REPLICATION SLOT ... LOGICAL on a replication=database psycopg 3 connection;
                CopyBoth read with psycopg.pq's PQgetCopyData, a standby status update ('r') every
                second reporting the last Commit read as flushed
+decode       : the same, each message through the project's pgoutput Decoder (psycopg's loaders)

"raw" counts the changes by their message tag only. Columns: changes/s, the client process's CPU µs
per change (the box is CPU-bound: a reader's CPU is taken from the tick's encode and send), and the
server's (all its processes, from /proc: the private server serves nothing else).

--live: --writers processes commit --txn-row transactions at N changes/s in all for --live-seconds; the
reader decodes them either peeking every 50 ms (and advancing) or streaming, and the latency from
the commit (pgoutput's commit timestamp) to the decoded change is recorded: p50/p99, the round of
the two with the lower p99.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import select
import struct
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from poller.sources.pg_logical.peek import _PEEK_SQL, loader, stream
from poller.sources.pg_logical.pgoutput import Change, Decoder
from tests.support.private_postgres import LOGICAL_SETTINGS, start_private_postgres

# The replication protocol's CopyBoth messages ("Streaming Replication Protocol" in PostgreSQL's docs).
_XLOG = struct.Struct(">QQq")  # 'w' XLogData: start of the data, the server's WAL end, send time
_KEEPALIVE = struct.Struct(">Qqb")  # 'k': the server's WAL end, send time, reply requested
_STATUS = struct.Struct(">cQQQqb")  # 'r': written, flushed, applied, client time, reply requested
_XLOG_HEADER = 1 + _XLOG.size
_PG_EPOCH_US = 946_684_800_000_000  # 2000-01-01 in Unix microseconds
_COMMIT_END = slice(10, 18)  # pgoutput Commit: 'C', flags, commit LSN, end LSN, time
_CHANGE_TAGS = frozenset(b"IUDT")


def xlog_payload(message: bytes | memoryview) -> bytes:
    """The pgoutput message an XLogData ('w') message carries."""
    if message[0] != ord("w"):
        raise ValueError(f"not an XLogData message: {bytes(message[:1])!r}")
    return bytes(message[_XLOG_HEADER:])


def keepalive(message: bytes | memoryview) -> tuple[int, bool]:
    """A primary keepalive ('k'): the server's WAL end and whether it asks for a reply now."""
    if message[0] != ord("k"):
        raise ValueError(f"not a keepalive message: {bytes(message[:1])!r}")
    wal_end, _sent, reply = _KEEPALIVE.unpack_from(message, 1)
    return wal_end, bool(reply)


def status_update(received: int, confirmed: int, now_us: int) -> bytes:
    """A standby status update: ``received`` as written, ``confirmed`` as flushed and applied.

    The server moves the slot's confirmed_flush_lsn to the flushed position only; a consumer
    that must not lose changes reports its checkpoint there, never what it merely received.
    """
    if confirmed > received:
        raise ValueError("cannot confirm past what was received")
    return _STATUS.pack(b"r", received, confirmed, confirmed, now_us - _PG_EPOCH_US, 0)


class SlotStream:
    """One START_REPLICATION ... LOGICAL stream of a pgoutput slot over psycopg 3 (no other library)."""

    def __init__(self, dsn: str, slot: str, publication: str, start: int = 0) -> None:
        self.conn = psycopg.connect(dsn, replication="database", autocommit=True)
        self._pgconn = self.conn.pgconn
        self.received = self.confirmed = start
        lsn = f"{start >> 32:X}/{start & 0xFFFFFFFF:X}"
        # Identifiers from this benchmark, not input; the replication grammar takes no bind parameters.
        self.conn.execute(
            f"START_REPLICATION SLOT {slot} LOGICAL {lsn} (proto_version '1', publication_names '{publication}')"
        )

    def messages(self, idle: float) -> Iterator[bytes]:
        """The pgoutput messages as they come; returns after ``idle`` seconds without one."""
        pgconn, sock = self._pgconn, self._pgconn.socket
        while True:
            n, data = pgconn.get_copy_data(1)
            if n > 0:
                tag = data[0]
                if tag == 0x77:  # 'w'
                    self.received = max(self.received, _XLOG.unpack_from(data, 1)[1])
                    yield bytes(data[_XLOG_HEADER:])
                elif tag == 0x6B:  # 'k'
                    wal_end, reply = keepalive(data)
                    self.received = max(self.received, wal_end)
                    if reply:  # else the server ends the connection after wal_sender_timeout
                        self.confirm(self.confirmed)
                continue
            if n < 0:
                raise RuntimeError("the server ended the replication stream")
            if not select.select([sock], [], [], idle)[0]:
                return
            pgconn.consume_input()

    def confirm(self, lsn: int) -> None:
        """Report ``lsn`` flushed (the slot may release the WAL before it)."""
        self.confirmed = max(self.confirmed, lsn)
        self._pgconn.put_copy_data(status_update(max(self.received, self.confirmed), self.confirmed, _now_us()))
        while self._pgconn.flush():
            select.select([], [self._pgconn.socket], [], 1.0)

    def close(self) -> None:
        """Close, and wait (up to 10 s) until the server reaped its walsender: the slot is free
        again and the walsender's CPU is in the postmaster's (see server_cpu)."""
        pid = self.conn.info.backend_pid
        self.conn.close()
        deadline = time.monotonic() + 10.0
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.01)  # a poll for the process's end (another host's server: no such file, no wait)


def _now_us() -> int:
    return time.time_ns() // 1000


def _lsn_text(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


# ----------------------------------------------------------------------------------------------
# Reading a slot to a count of changes


class Counter:
    """Changes of complete transactions, by tag only (raw) or decoded; the last Commit's end."""

    def __init__(self, load: Callable[[int, bytes], Any] | None) -> None:
        self.load, self.changes, self.end, self._pending = load, 0, 0, 0
        self.decoder = Decoder(load) if load is not None else None
        self.decoded: list[Change] = []

    def restart(self) -> None:
        """A new decoding session (a peek): what a transaction cut short held is read again."""
        self._pending = 0
        if self.load is not None:
            self.decoder = Decoder(self.load)

    def feed(self, data: bytes) -> None:
        if self.decoder is not None:
            for change in self.decoder.feed(data):
                self.changes += 1
                self.end = change.end_lsn
                self.decoded.append(change)
            return
        tag = data[0]
        if tag in _CHANGE_TAGS:
            self._pending += 1
        elif tag == 0x43:  # 'C'
            self.changes += self._pending
            self._pending = 0
            self.end = int.from_bytes(data[_COMMIT_END])


def peek_loop(
    engine: sa.Engine, slot: str, publication: str, counter: Counter, total: int, messages: int | None
) -> None:
    """The poller's read: peek, then move the slot to what was read, until ``total`` changes."""
    while counter.changes < total:
        counter.restart()
        with engine.begin() as conn:
            with closing(stream(conn, _PEEK_SQL, {"slot": slot, "n": messages, "pub": publication})) as rows:
                for data in rows:
                    counter.feed(data)
            conn.execute(sa.text("SELECT pg_replication_slot_advance(:s, CAST(:l AS pg_lsn))"),
                         {"s": slot, "l": _lsn_text(counter.end)})  # fmt: skip
        if len(counter.decoded) > 50_000:
            counter.decoded.clear()  # a poller hands them on: memory stays bounded


def stream_loop(dsn: str, slot: str, publication: str, counter: Counter, total: int) -> None:
    """START_REPLICATION to ``total`` changes, confirming the last Commit read every second."""
    reader = SlotStream(dsn, slot, publication)
    try:
        confirmed_at = time.monotonic()
        for data in reader.messages(idle=30.0):
            counter.feed(data)
            if counter.changes >= total:
                break
            if len(counter.decoded) > 50_000:
                counter.decoded.clear()
            if time.monotonic() - confirmed_at > 1.0:
                reader.confirm(counter.end)
                confirmed_at = time.monotonic()
        if counter.changes < total:
            raise RuntimeError(f"the stream went quiet after {counter.changes} of {total} changes")
    finally:
        reader.close()


# ----------------------------------------------------------------------------------------------
# Setup and the measures


def _fill(engine: sa.Engine, table: str, changes: int, txn: int) -> None:
    """``changes`` inserts committed ``txn`` at a time, server-side (a procedure commits in its loop)."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:  # CALL may then COMMIT
        conn.execute(sa.text(f"""
            CREATE OR REPLACE PROCEDURE fill(total int, txn int) LANGUAGE plpgsql AS $$
            BEGIN
              FOR s IN 0 .. total - 1 BY txn LOOP
                INSERT INTO {table} (id, version, v, committed_at)
                  SELECT g, g, 'x', extract(epoch FROM clock_timestamp()) FROM generate_series(s, s + txn - 1) g;
                COMMIT;
              END LOOP;
            END $$"""))  # fmt: skip
        conn.execute(sa.text("CALL fill(:n, :t)"), {"n": changes, "t": txn})


def _copy_slot(engine: sa.Engine, source: str, target: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT pg_copy_logical_replication_slot(:s, :t)"), {"s": source, "t": target})


def _drop_slot(engine: sa.Engine, slot: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = :s"),
            {"s": slot},
        )


def server_cpu(postmaster: int) -> float:
    """CPU seconds of the private server so far: the postmaster, its live backends, and the ended
    ones it reaped (a walsender ends with its stream)."""
    tick = os.sysconf("SC_CLK_TCK")

    def fields(pid: int) -> list[str]:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces

    own = fields(postmaster)
    total = sum(int(x) for x in own[11:15])  # utime stime cutime cstime
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                f = fields(int(entry))
            except OSError:
                continue  # ended meanwhile
            if int(f[1]) == postmaster:
                total += int(f[11]) + int(f[12])
    return total / tick


def measure(
    kind: str, decode: bool, engine: sa.Engine, dsn: str, total: int, messages: int, postmaster: int
) -> tuple[float, float, float]:
    """(changes/s, client and server CPU µs per change) reading a copy of the backlog's slot to its end."""
    _copy_slot(engine, "backlog", "m")
    try:
        with engine.connect() as conn:
            load = loader(conn) if decode else None
            counter = Counter(load)
            wall, cpu, server = time.perf_counter(), time.process_time(), server_cpu(postmaster)
            if kind.startswith("peek"):
                peek_loop(engine, "m", "pub", counter, total, None if kind == "peek all" else messages)
            else:
                stream_loop(dsn, "m", "pub", counter, total)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            server = server_cpu(postmaster) - server
        if counter.changes != total:
            raise RuntimeError(f"{kind}: read {counter.changes} changes, expected {total}")
        return total / wall, cpu * 1e6 / total, server * 1e6 / total
    finally:
        _drop_slot(engine, "m")


def _writer(dsn: str, rate: float, txn: int, seconds: float, first: int) -> None:
    with psycopg.connect(dsn) as conn:
        started, i = time.monotonic(), first
        while time.monotonic() - started < seconds:
            due = started + (i - first) / rate
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)  # the writer's pace
            conn.execute(
                "INSERT INTO orders (id, version, v, committed_at) SELECT g, g, 'x', extract(epoch FROM "
                "clock_timestamp()) FROM generate_series(CAST(%s AS int), CAST(%s AS int)) g",
                (i, i + txn - 1),
            )
            conn.commit()
            i += txn


class _Writers:
    """``count`` writer processes sharing ``rate``, each on its own range of ids."""

    def __init__(self, dsn: str, rate: int, txn: int, seconds: float, first: int, count: int) -> None:
        span = int(rate * seconds) + 10_000
        spawn = multiprocessing.get_context("spawn")
        self._procs = [spawn.Process(target=_writer, args=(dsn, rate / count, txn, seconds, first + j * span))
                       for j in range(count)]  # fmt: skip

    def start(self) -> None:
        for p in self._procs:
            p.start()

    def is_alive(self) -> bool:
        return any(p.is_alive() for p in self._procs)

    def join(self) -> None:
        for p in self._procs:
            p.join()

    def failed(self) -> bool:
        return any(p.exitcode != 0 for p in self._procs)

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()


def _latencies(changes: list[Change]) -> list[float]:
    """Seconds from each change's commit (pgoutput's commit timestamp) to now."""
    now = _now_us()
    return [(now - c.commit_time_us - _PG_EPOCH_US) / 1e6 for c in changes]


def _live_peek(engine: sa.Engine, dsn: str, writer: _Writers, counter: Counter, latencies: list[float]) -> None:
    """Peek every 50 ms and advance to what was read, until the writer ended and a peek found nothing."""
    while writer.is_alive() or counter.decoded:
        tick = time.monotonic()
        counter.decoded.clear()
        counter.restart()
        with engine.begin() as conn:
            with closing(stream(conn, _PEEK_SQL, {"slot": "live", "n": 100_000, "pub": "pub"})) as rows:
                for data in rows:
                    counter.feed(data)
            latencies += _latencies(counter.decoded)
            if counter.end:
                conn.execute(sa.text("SELECT pg_replication_slot_advance('live', CAST(:l AS pg_lsn))"),
                             {"l": _lsn_text(counter.end)})  # fmt: skip
        time.sleep(max(0.0, 0.05 - (time.monotonic() - tick)))  # the peek interval under test


def _live_stream(engine: sa.Engine, dsn: str, writer: _Writers, counter: Counter, latencies: list[float]) -> None:
    """Stream, confirming once a second, until the writer ended and the stream went quiet."""
    reader = SlotStream(dsn, "live", "pub")
    try:
        confirmed_at, writing = time.monotonic(), True
        while writing:  # the writer process starts slowly: a quiet stream is not the end before it ends
            writing = writer.is_alive()
            for data in reader.messages(idle=0.5):  # once it ended: until the stream is quiet
                counter.feed(data)
                if counter.decoded:
                    latencies += _latencies(counter.decoded)
                    counter.decoded.clear()
                if time.monotonic() - confirmed_at > 1.0:  # once a second, not per message
                    reader.confirm(counter.end)
                    confirmed_at = time.monotonic()
                    if writing and not writer.is_alive():
                        break
    finally:
        reader.close()


def live(
    kind: str,
    engine: sa.Engine,
    dsn: str,
    rate: int,
    txn: int,
    seconds: float,
    first: int,
    postmaster: int,
    writers: int = 1,
) -> dict[str, float]:
    """A writer at ``rate`` changes/s; the reader peeking every 50 ms or streaming: latency per change."""
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT pg_create_logical_replication_slot('live', 'pgoutput')"))
    latencies: list[float] = []
    writer = _Writers(dsn, rate, txn, seconds, first, writers)
    try:
        with engine.connect() as conn:
            counter = Counter(loader(conn))
        cpu, server = time.process_time(), server_cpu(postmaster)
        writer.start()
        (_live_peek if kind == "peek" else _live_stream)(engine, dsn, writer, counter, latencies)
        writer.join()
        cpu, server = time.process_time() - cpu, server_cpu(postmaster) - server
        if writer.failed():
            raise RuntimeError("a writer failed")
    finally:
        writer.kill()
        _drop_slot(engine, "live")
    latencies.sort()
    n = len(latencies)
    if n < rate * seconds * 0.5:
        raise RuntimeError(f"{kind}: decoded {n} changes of a writer at {rate}/s for {seconds} s")
    return {
        "changes": n,
        "rate": n / seconds,
        "p50": latencies[n // 2],
        "p99": latencies[min(n - 1, n * 99 // 100)],
        "cpu_us": cpu * 1e6 / n,
        "server_us": server * 1e6 / n,
    }


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=200_000)
    parser.add_argument("--txn", type=int, default=10, help="rows per source transaction")
    parser.add_argument(
        "--peek-messages", type=int, default=12_000, help="messages per peek (batch 1000: 3 * 1000 * 4, as peek.py)"
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--live", type=int, action="append", help="writer changes/s (repeatable; 0: none)")
    parser.add_argument("--live-seconds", type=float, default=10.0)
    parser.add_argument("--writers", type=int, default=1, help="writer processes sharing a live rate")
    args = parser.parse_args()
    with start_private_postgres(LOGICAL_SETTINGS) as pg:
        dsn = f"host=127.0.0.1 port={pg.port} user=postgres dbname=test"
        engine = sa.create_engine(pg.url)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE orders (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, v TEXT, "
                                 "committed_at FLOAT)"))  # fmt: skip
            conn.execute(sa.text("CREATE PUBLICATION pub FOR TABLE orders"))
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_create_logical_replication_slot('backlog', 'pgoutput')"))
        _fill(engine, "orders", args.changes, args.txn)
        print(f"psycopg {psycopg.__version__}, libpq {psycopg.pq.version()}; {args.changes} changes in "
              f"transactions of {args.txn}; best of {args.repeat}, interleaved; load before {_load()}")  # fmt: skip
        cases = [("peek all", False), ("peek", False), ("stream", False), ("peek", True), ("stream", True)]
        best: dict[tuple[str, bool], tuple[float, float, float]] = {}
        for _ in range(args.repeat):
            for kind, decode in cases:
                result = measure(kind, decode, engine, dsn, args.changes, args.peek_messages, pg.server_pid)
                if result[0] > best.get((kind, decode), (0.0, 0.0, 0.0))[0]:
                    best[kind, decode] = result
        print(f"load after {_load()}")
        print("| read | changes/s | vs peek | client CPU µs/change | server CPU µs/change |")
        print("|---|---:|---:|---:|---:|")
        for kind, decode in cases:
            rate, cpu, server = best[kind, decode]
            name = f"{kind} {'+decode' if decode else 'raw'}"
            print(f"| {name} | {rate:,.0f} | {rate / best['peek', decode][0]:.2f} | {cpu:.2f} | {server:.2f} |")
        first = args.changes
        for rate in [r for r in (args.live or [2000, 8000]) if r > 0]:
            rows: dict[str, dict[str, float]] = {}
            for _ in range(2):
                for kind in ("peek", "stream"):
                    run = live(kind, engine, dsn, rate, args.txn, args.live_seconds, first, pg.server_pid, args.writers)
                    first += args.writers * (int(rate * args.live_seconds) + 10_000)
                    if kind not in rows or run["p99"] < rows[kind]["p99"]:
                        rows[kind] = run
            print(f"\nlive: {args.writers} writer(s) offered {rate:,}/s for {args.live_seconds:.0f} s; load {_load()}")
            print("| read | decoded/s | p50 s | p99 s | client CPU µs/change | server CPU µs/change |")
            print("|---|---:|---:|---:|---:|---:|")
            for kind, r in rows.items():
                label = "peek every 50 ms" if kind == "peek" else "stream"
                print(f"| {label} | {r['rate']:,.0f} | {r['p50']:.3f} | {r['p99']:.3f} | {r['cpu_us']:.2f} "
                      f"| {r['server_us']:.2f} |")  # fmt: skip
        engine.dispose()


if __name__ == "__main__":
    main()
