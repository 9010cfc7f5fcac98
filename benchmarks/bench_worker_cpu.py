"""The worker's CPU per event, in process (issue 41; run by hand): no broker, no other process.

    python benchmarks/bench_worker_cpu.py [--events 500] [--rounds 5] [--seconds 1.0] [--baseline DIR]
                                          [--profile STAGE] [--json]

One message body of ``--events`` events shaped like a live pg_logical poller's (the capacity
benchmark's table: ``id, version, v, committed_at``; cursor ``(commit LSN, seq)``, 10 changes a
transaction sharing a commit time, ``change``, ``table``), packed by ``shared.messages.pack_batch``
as the poller packs it. Each stage is repeated for ``--seconds`` of CPU time and reported in CPU µs
per event (the thread's CPU time, so waiting for a core on a shared machine is left out; the best
of ``--rounds``: the least disturbed round, caches shared with other processes still cost):

* ``decode``: ``shared.codec.decode_batch`` of the body;
* ``worker``: ``worker.runtime.Worker.process`` of a delivery (decode, the default hooks, the
  context, a no-op handler, the outcome);
* ``function``: what ``dbfanout run`` does for a received message after the receive: the
  ``azure.functions.ServiceBusMessage`` built from an SDK message (``dbfanout.host.messages``), then
  the app's ``work_<queue>`` function (``worker.functions``: ``WorkerApp.process``).

``--baseline DIR``: also run this script against another checkout (``git worktree add
/tmp/base-worker main``), in a child process with ``PYTHONPATH=DIR``, round by round interleaved
with this checkout's, so both see the same load. ``--profile STAGE`` prints cProfile's top entries
for one stage instead. Figures on a busy machine are upper bounds of the cost (lower bounds of the
rate); the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.messages import OutgoingMessage

STAGES = ("decode", "worker", "function")
ROOT = Path(__file__).resolve().parent.parent


def body(events: int, message: int = 0) -> bytes:
    """A pg_logical-shaped message body of ``events`` events (one message, as the poller packs it);
    ``message``: its place in a stream of them (distinct event ids, later LSNs and times)."""
    return page(events, message).body


def page(events: int, message: int = 0) -> OutgoingMessage:
    """The message :func:`body` is the body of."""
    from shared.messages import pack_batch
    from shared.models import Batch, Lsn, RowChange

    base = dt.datetime(2026, 11, 29, 1, 0, tzinfo=dt.UTC)
    changes = []
    for j in range(events):
        i = message * events + j
        txn = i // 10
        committed = base + dt.timedelta(milliseconds=7 * txn, microseconds=13 * txn)
        after = {"id": i, "version": 1, "v": f"row {i} " + "x" * 24, "committed_at": committed.timestamp()}
        changes.append(
            RowChange(
                f"{i:064x}",
                "upsert",
                {"id": i},
                (Lsn(0x16_B374D848 + 4096 * txn), i % 10),
                after,
                "orders",
                change="insert",
                table="public.orders",
                committed_at=committed,
            )
        )
    batch = Batch("orders", f"batch-{message}", "sha256:bench", tuple(changes), read_at=base)
    (out,) = pack_batch(batch, 1024 * 1024)
    return out


def _noop(events: list[Any], context: Any) -> None:
    return None


def stages(events: int) -> dict[str, Callable[[], object]]:
    """Each stage as a no-argument call, everything it needs built once."""
    from azure.servicebus import ServiceBusReceivedMessage
    from azure.servicebus._pyamqp.message import Header, Message, Properties

    from dbfanout.host.messages import to_functions_message
    from shared.codec import decode_batch
    from shared.config import AppConfig, Config, PollerConfig
    from shared.messages import PROP_EVENT_COUNT, PROP_POLLER, PROP_SCHEMA
    from worker.functions import WorkerApp
    from worker.runtime import Delivery, Worker

    data = body(events)
    poller = PollerConfig(
        name="orders", source_url="sqlite://", cursor="version", pk=("id",), queue="orders-changes", table="orders"
    )
    config = Config(AppConfig("bench"), {"orders": poller})
    worker = Worker(config, handlers={"orders": _noop})
    delivery = Delivery(body=data, message_id="m-1", delivery_count=1, application_properties={"a": "b"})
    app = WorkerApp(config)
    app._worker = worker  # the no-op handler; nothing else of the app is opened by a success
    amqp = Message(
        data=[data],
        header=Header(delivery_count=0),
        properties=Properties(message_id=b"m-1", content_type=b"application/json", subject=b"orders"),
        application_properties={
            PROP_SCHEMA.encode(): b"dbfanout.batch.v1",
            PROP_POLLER.encode(): b"orders",
            PROP_EVENT_COUNT.encode(): events,
        },
        message_annotations={
            b"x-opt-enqueued-time": 1764378000000,
            b"x-opt-sequence-number": 7,
            b"x-opt-locked-until": 1764378060000,
        },
    )
    received = ServiceBusReceivedMessage(amqp, receive_mode="peeklock", frame=None, receiver=None)
    return {
        "decode": lambda: decode_batch(data),
        "worker": lambda: worker.process(delivery),
        "function": lambda: app.process(to_functions_message(received)),
    }


def measure(call: Callable[[], object], seconds: float) -> float:
    """CPU seconds per call (this thread's: time spent waiting for a core on a busy machine is not
    counted), over as many calls as fit in ``seconds`` of that CPU time (at least 3)."""
    call()  # warm
    n, started = 0, time.thread_time()
    while True:
        call()
        n += 1
        elapsed = time.thread_time() - started
        if elapsed >= seconds and n >= 3:
            return elapsed / n


def one_round(events: int, seconds: float) -> dict[str, float]:
    """CPU µs per event of each stage, measured once, and of it the cyclic collector's (``gc:<stage>``).

    The heap is what the stages imported and built (tens of thousands of objects, fewer than a
    host's). A checkout whose host freezes the heap once started (``dbfanout.host.host.freeze_heap``)
    has it frozen here too, as ``dbfanout run`` does before it serves.
    """
    calls = stages(events)
    import dbfanout.host.host as host

    freeze = getattr(host, "freeze_heap", None)
    if freeze is not None:
        freeze()
    collecting = [0.0, 0.0]  # total, started

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collecting[1] = time.thread_time()
        else:
            collecting[0] += time.thread_time() - collecting[1]

    gc.callbacks.append(on_gc)
    out: dict[str, float] = {}
    for name, call in calls.items():
        collecting[0] = 0.0
        per_call = measure(call, seconds)
        calls_made = seconds / per_call  # about: measure ran for ``seconds`` of CPU
        out[name] = per_call / events * 1e6
        out["gc:" + name] = collecting[0] / calls_made / events * 1e6
    gc.callbacks.remove(on_gc)
    return out


def _child(dir_: str, events: int, seconds: float) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": dir_}
    cmd = [sys.executable, __file__, "--child", "--events", str(events), "--seconds", str(seconds)]
    out = subprocess.run(cmd, env=env, cwd=dir_, check=True, capture_output=True, text=True).stdout
    result: dict[str, float] = json.loads(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--events", type=int, default=500, help="events in the message")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (each: every stage, each code)")
    parser.add_argument("--seconds", type=float, default=1.0, help="how long each stage repeats in a round")
    parser.add_argument("--baseline", help="another checkout to measure interleaved (e.g. /tmp/base-worker)")
    parser.add_argument("--profile", choices=STAGES, help="cProfile one stage of this checkout instead")
    parser.add_argument("--json", action="store_true", help="print the rounds as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_round(args.events, args.seconds)))
        return
    if args.profile:
        import cProfile
        import pstats

        call = stages(args.events)[args.profile]
        call()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200):
            call()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return
    codes = {"this": str(ROOT)} | ({"baseline": args.baseline} if args.baseline else {})
    rounds: dict[str, list[dict[str, float]]] = {code: [] for code in codes}
    for _ in range(args.rounds):
        for code, dir_ in codes.items():
            rounds[code].append(_child(dir_, args.events, args.seconds))
            line = "  ".join(f"{k} {v:6.2f}" for k, v in rounds[code][-1].items())
            print(f"{code:<9} {line}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"load": os.getloadavg(), "rounds": rounds}, indent=2))
        return
    print(f"µs per event of a {args.events}-event message, best of {args.rounds} (load average {os.getloadavg()})")
    print(f"{'code':<9} " + " ".join(f"{s:>9} {'(gc)':>6}" for s in STAGES))
    for code, results in rounds.items():
        best = [min(results, key=lambda r, s=s: r[s]) for s in STAGES]  # type: ignore[misc]
        print(f"{code:<9} " + " ".join(f"{r[s]:9.2f} {r['gc:' + s]:6.2f}" for s, r in zip(STAGES, best, strict=True)))


if __name__ == "__main__":
    main()
