"""End-to-end fan-out: committed source rows → poller → Service Bus emulator → worker → handler.

    .venv/bin/python benchmarks/bench_fanout.py [--rows 20000] [--batch 500]

The emulator runs in its own process (as `dbfanout emulator servicebus`), state on Azurite, source
and handler target on SQLite. Phase 1 polls until caught up; phase 2 consumes until every event
was handled (Functions semantics: peek-lock, complete after the handler). Prints rows/s per phase
and end to end, and where the time went: fetch, encode, send, commit | receive, handle, settle.
Opening the sender and the receiver link (about a second each, once per process) is timed apart:
in a short run it dominated "send" and "receive" per row.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from azure.servicebus import ServiceBusClient  # noqa: E402

from poller.sinks.servicebus import ServiceBusSink  # noqa: E402
from poller.sources.keyset.source import SqlSource  # noqa: E402
from poller.state.blob import open_state_store  # noqa: E402
from poller.tick.lifecycle import run_tick  # noqa: E402
from shared.config import AppConfig, Config  # noqa: E402
from shared.models import Batch, HandlerContext, RowChange  # noqa: E402
from shared.servicebus import QueueSender  # noqa: E402
from shared.settings import StorageConnection  # noqa: E402
from tests.poller.tick_support import SourceTable, make_poller  # noqa: E402
from tests.support.azurite import start_azurite  # noqa: E402
from worker.consumer import delivery_from_sdk  # noqa: E402
from worker.idempotency import ProcessedEvents  # noqa: E402
from worker.runtime import Worker  # noqa: E402

spent: dict[str, float] = defaultdict(float)


@contextmanager
def stage(name: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        spent[name] += time.perf_counter() - started


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with stage(name):
            return fn(*args, **kwargs)

    return wrapper


def start_emulator(queue: str) -> tuple[subprocess.Popen[str], str]:
    config = Path(tempfile.mkdtemp()) / "Config.json"
    queue_props = {"RequiresDuplicateDetection": True, "MaxDeliveryCount": 10, "LockDuration": "PT1M"}
    namespace = {"Name": "sbemulatorns", "Queues": [{"Name": queue, "Properties": queue_props}]}
    config.write_text(json.dumps({"UserConfig": {"Namespaces": [namespace]}}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "sbemulator", "servicebus", "--config", str(config), "--port", "0", "--http-port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"(Endpoint=sb://\S+)", line)
        if match:
            return proc, match.group(1)
    raise RuntimeError("the emulator did not print its connection string")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dbfanout-fanout-"))
    azurite = start_azurite()
    emulator, connection = start_emulator("orders-changes")
    try:
        table = SourceTable(f"sqlite:///{tmp / 'source.db'}")
        for lo in range(0, args.rows, 5000):
            table.upsert(range(lo, min(args.rows, lo + 5000)))
        poller = replace(make_poller(str(table.engine.url)), batch_size=args.batch, max_batches_per_tick=10_000)
        target = sa.create_engine(f"sqlite:///{tmp / 'target.db'}")
        with target.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE target (id INTEGER PRIMARY KEY, version BIGINT, v TEXT)")
        processed = ProcessedEvents(target)

        def handle(events: list[RowChange], context: HandlerContext) -> None:
            with target.begin() as conn:
                for e in processed.fresh(conn, events):
                    conn.execute(
                        sa.text("INSERT OR REPLACE INTO target VALUES (:i, :ver, :v)"),
                        {"i": e.pk["id"], "ver": e.cursor, "v": (e.after or {}).get("v")},
                    )

        client = ServiceBusClient.from_connection_string(connection)
        store = open_state_store(StorageConnection(connection_string=azurite.connection_string), "bench", "b", "orders")
        source = SqlSource(poller)
        source.fetch = timed("fetch", source.fetch)  # type: ignore[method-assign]
        store.commit = timed("commit", store.commit)  # type: ignore[method-assign]
        sender = QueueSender(client, poller.queue)
        send_all = sender.send_all
        sends = [0]

        def send_timed(messages: Any) -> None:
            # The first send opens the link (CBS auth, attach: about a second, once per process):
            # timed apart, so "send" is what each further message costs.
            sends[0] += 1
            with stage("send" if sends[0] > 1 else "sender link"):
                send_all(messages)

        sender.send_all = send_timed  # type: ignore[method-assign]
        sink = ServiceBusSink(poller, sender)
        sink.messages_for = timed("encode", sink.messages_for)  # type: ignore[method-assign]

        started = time.perf_counter()
        while run_tick(poller, source, store, sink, owner_id="bench").stop_reason != "caught_up":
            pass
        polled = time.perf_counter()

        worker = Worker(Config(AppConfig("bench"), {poller.name: poller}), handlers={poller.name: handle})
        handled = 0
        with stage("receiver link"):
            receiver = client.get_queue_receiver(poller.queue, prefetch_count=200)
            receiver.__enter__()  # opens the link (timed apart, as for the sender)
        with receiver:
            while handled < args.rows:
                with stage("receive"):
                    messages = receiver.receive_messages(max_message_count=50, max_wait_time=5)
                if not messages:
                    raise RuntimeError(f"queue ran dry after {handled} of {args.rows} events")
                for msg in messages:
                    with stage("handle"):
                        delivery = delivery_from_sdk(msg)
                        worker.process(delivery)
                    with stage("settle"):
                        receiver.complete_message(msg)
                    handled += int((msg.application_properties or {}).get(b"dbfanout-event-count", 0))
        done = time.perf_counter()
        assert processed.count() == args.rows
        client.close()
    finally:
        emulator.terminate()
        azurite.stop()

    poll_s, consume_s, total_s = polled - started, done - polled, done - started
    print(f"rows={args.rows} batch={args.batch} python={sys.version.split()[0]}")
    print(f"poll phase     {args.rows / poll_s:>10,.0f} rows/s  ({poll_s:.2f} s)")
    print(f"consume phase  {args.rows / consume_s:>10,.0f} rows/s  ({consume_s:.2f} s)")
    print(f"end to end     {args.rows / total_s:>10,.0f} rows/s  ({total_s:.2f} s)")
    for name in ("fetch", "encode", "send", "commit", "receive", "handle", "settle"):
        print(f"  {name:<8} {spent[name]:>7.2f} s  {spent[name] / args.rows * 1e6:>8.1f} us/row")
    print(
        f"  opening the links (once per process, in the phases above): sender {spent['sender link']:.2f} s,"
        f" receiver {spent['receiver link']:.2f} s"
    )


_ = Batch  # imported for readers: the unit the poller sends

if __name__ == "__main__":
    main()
