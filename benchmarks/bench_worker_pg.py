"""bench_worker's ``local`` contestant on pg_logical-shaped messages (issue 41; run by hand).

    python benchmarks/bench_worker_pg.py [--cardinality many,one] [--messages 300] [--events 500]

``bench_worker.py`` prefills its queue with keyset-shaped events (an integer cursor, no tags). A
live pg_logical poller's events carry a tagged ``(commit LSN, seq)`` cursor, a commit time, a
change and a table (``bench_worker_cpu.page``), and those cost the worker more to decode. This runs
``bench_worker.run_case`` (``dbfanout run`` draining a prefilled emulator queue, no-op handler)
with such messages, and prints the host process's CPU µs per event beside the drain rate. Which
code runs is the ``PYTHONPATH``'s (e.g. ``PYTHONPATH=/tmp/base-worker`` for main's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import bench_worker
from bench_worker_cpu import page

from tests.support.azurite import start_azurite
from tests.support.databases import PG_URL


def _prefill(connection: str, queue: str, messages: int, events: int) -> None:
    from azure.servicebus import ServiceBusClient

    from shared.servicebus import QueueSender

    out = [page(events, m) for m in range(messages)]
    with ServiceBusClient.from_connection_string(connection) as client:
        sender = QueueSender(client, queue)
        for k in range(0, len(out), 20):
            sender.send_all(out[k : k + 20])
        sender.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cardinality", default="many,one", help="comma list: one,many")
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--events", type=int, default=500)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    args.db_url = PG_URL  # bench_worker opens an engine; the no-op handler never uses it
    bench_worker._prefill = _prefill  # the messages of a live pg_logical poller
    tmp = Path(tempfile.mkdtemp(prefix="bench-worker-pg-"))
    azurite = start_azurite()
    try:
        for n, cardinality in enumerate(c for c in args.cardinality.split(",") if c):
            case = bench_worker.run_case("local", cardinality, "noop", args, tmp / str(n), azurite.connection_string)
            us = case.cpu / case.rate * 1e6 if case.rate else float("nan")
            print(
                f"{cardinality:<5} {case.rate:9.0f} events/s  cpu {case.cpu:5.2f} s/s  {us:6.2f} µs/event"
                f"  load {case.load:5.2f}  code {os.environ.get('PYTHONPATH', '')}",
                flush=True,
            )
    finally:
        azurite.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
