"""Worker capacity: the events a second one worker process handles (issue 31; run by hand).

    python benchmarks/bench_worker.py [--contestant platform,local] [--cardinality one,many]
                                      [--handler noop,pg] [--messages 500] [--events 100]
                                      [--db-url URL] [--json]

Each case prefills a queue of the project's Service Bus emulator (a process of its own) with
``--messages`` messages of ``--events`` events each, packed as the poller packs them
(``shared.messages.pack_batch``), then starts one worker process on an app folder of the real
``function_app.py`` (one poller ``orders`` on that queue, its timer never due) and times the drain.

Contestants, and exactly what each includes:

* ``local``: ``dbfanout run`` (``dbfanout/host``). Its Service Bus pump (peek-lock receive with
  the Python SDK: one message per receive for ``one``, up to ``maxMessageBatchSize`` for ``many``;
  a complete per message), the conversion of each message into ``azure.functions.ServiceBusMessage``
  (``dbfanout/host/messages.py``), the function ``work_<queue>`` (envelope decode, the handler) on a
  pool of ``maxConcurrentCalls`` threads. The timer thread idles beside it.
* ``platform``: a process that indexes ``function_app.py`` with the platform's own
  ``azure-functions-runtime`` (loader and registry, as the Python worker does) and invokes the
  function as the runtime's ``invocation_request`` does: the host's ``TypedData`` for the message
  (body as ``bytes``, system properties as trigger metadata; ``many``: ``collection_bytes`` and the
  ``...Array`` metadata) goes through the runtime's ``bindings.meta.from_incoming_proto`` (the
  ``azure.functions`` Service Bus converter), then the function is called. On Azure the receive and
  the settlement run in the .NET host and reach the worker over gRPC; neither exists here, so this
  process receives (peek-lock, up to 32 messages a receive) and completes with the Python SDK
  itself. ``one``: the messages of a receive run on a pool of ``maxConcurrentCalls`` threads (the
  worker runs sync functions on a thread pool; the host keeps at most that many in flight);
  ``many``: one call at a time with up to ``maxMessageBatchSize`` messages (the extension's batch
  loop runs one call at a time). The protobuf (de)serialisation and the gRPC hop are not included.
  The "in worker" column is the events a second over the wall time from the first conversion of a
  receive to its last call's end, summed over the receives: receive and settlement left out.

Handlers: ``noop`` (only appends its event count and the time to a file: every case does) and
``pg``: ``worker.idempotency.ProcessedEvents`` records the events' ids in a table of its own on
PostgreSQL (``--db-url``), one transaction per call, as ``handlers/example.py`` does.

The rate is (events - the first call's) / (last call's time - first call's time): start-up and the
first receive are left out. CPU is the worker process's CPU seconds a second over the same span.
Every figure on a shared machine is a lower bound: the load average is printed beside it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from bench_latency import ROOT, _cpu_seconds, _start_emulator, _stop

from tests.host.app_support import AppDir, HostProcess
from tests.support.azurite import start_azurite
from tests.support.databases import PG_URL

NEVER = "0 0 0 1 1 *"  # the poller's timer: due once a year, never during a run
FETCH = 32  # messages a platform receive asks for

HANDLER = '''
"""bench_worker's handler: BENCH_TABLE set, ProcessedEvents on BENCH_PG_URL; always one line a call."""
import os, threading, time
import sqlalchemy as sa
from worker.idempotency import ProcessedEvents

_lock = threading.Lock()
_path = os.environ["BENCH_OUT"]
_state = {}

def _processed():
    with _lock:
        if not _state:
            engine = sa.create_engine(os.environ["BENCH_PG_URL"], pool_size=16)
            _state["engine"] = engine
            _state["processed"] = ProcessedEvents(engine, os.environ["BENCH_TABLE"], create=False)
        return _state["engine"], _state["processed"]

def handle(events, context):
    if os.environ.get("BENCH_TABLE"):
        engine, processed = _processed()
        with engine.begin() as conn:
            processed.fresh(conn, events)
    line = f"{len(events)} {time.time():.6f}\\n"
    with _lock, open(_path, "a") as f:
        f.write(line)
'''


@dataclass
class Case:
    contestant: str
    cardinality: str
    handler: str
    messages: int
    events: int
    seconds: float = 0.0
    rate: float = 0.0  # events/s, drain
    in_worker: float = float("nan")  # events/s over conversion + calls only (platform)
    cpu: float = 0.0  # the worker process's CPU seconds a second
    load: float = 0.0


def _prefill(connection: str, queue: str, messages: int, events: int) -> None:
    """``messages`` messages of ``events`` fresh events each, as the poller packs and sends them."""
    from azure.servicebus import ServiceBusClient

    from shared.messages import pack_batch
    from shared.models import Batch, RowChange
    from shared.servicebus import QueueSender

    run = uuid.uuid4().hex[:8]
    out = []
    for m in range(messages):
        rows = [m * events + i for i in range(events)]
        changes = tuple(
            RowChange(f"ev-{run}-{i}", "upsert", {"id": i}, i, {"id": i, "v": "x" * 40}, "orders", table="orders")
            for i in rows
        )
        (message,) = pack_batch(Batch("orders", f"batch-{run}-{m}", "bench", changes), 256 * 1024)
        out.append(message)
    with ServiceBusClient.from_connection_string(connection) as client:
        sender = QueueSender(client, queue)
        for k in range(0, len(out), 50):
            sender.send_all(out[k : k + 50])
        sender.close()


def _calls(path: Path) -> list[tuple[int, float]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [(int(n), float(t)) for n, t in (line.split() for line in lines if line.endswith(tuple("0123456789")))]


def _wait_drained(path: Path, total: int, pid: int, timeout: float) -> tuple[list[tuple[int, float]], float, float]:
    """Wait until ``total`` events were handled; the calls, and the process's CPU at the first and last call."""
    deadline = time.monotonic() + timeout
    cpu_first = cpu_last = float("nan")
    while time.monotonic() < deadline:
        calls = _calls(path)
        if calls and cpu_first != cpu_first:
            cpu_first = _cpu_seconds(pid)
        if sum(n for n, _ in calls) >= total:
            cpu_last = _cpu_seconds(pid)
            return calls, cpu_first, cpu_last
        time.sleep(0.01)
    handled = sum(n for n, _ in _calls(path))
    raise TimeoutError(f"{handled} of {total} events handled in {timeout:g} s: see the worker's log")


def run_case(
    contestant: str, cardinality: str, handler: str, args: argparse.Namespace, tmp: Path, storage: str
) -> Case:
    case = Case(contestant, cardinality, handler, args.messages, args.events)
    tmp.mkdir(parents=True)
    queue = "work-" + uuid.uuid4().hex[:10]
    emulator, connection = _start_emulator(ROOT, tmp, queue, None)
    table = f"bench_processed_{uuid.uuid4().hex[:8]}" if handler == "pg" else ""
    engine = sa.create_engine(args.db_url)
    proc: subprocess.Popen[bytes] | None = None
    host: HostProcess | None = None
    try:
        if table:
            from worker.idempotency import ProcessedEvents

            ProcessedEvents(engine, table)  # created here: the handler's first call does not pay for it
        app = AppDir.create(
            tmp / "app",
            queue=queue,
            storage=storage,
            servicebus=connection,
            schedule=NEVER,
            source_url=f"sqlite:///{tmp / 'never-opened.db'}",
            handler="bench_worker_handler:handle",
            poller_toml=f'cardinality = "{cardinality}"\n',
        )
        (app.root / "bench_worker_handler.py").write_text(HANDLER)
        out = app.root / "handled.txt"
        env = {"BENCH_OUT": str(out), "BENCH_PG_URL": args.db_url, "BENCH_TABLE": table}
        _prefill(connection, queue, args.messages, args.events)
        os.environ.update(env)
        if contestant == "local":
            host = HostProcess(app).start()
            pid = host.proc.pid if host.proc else 0
        else:
            proc = _start_platform(app, queue, cardinality, env)
            pid = proc.pid
        calls, cpu0, cpu1 = _wait_drained(out, args.messages * args.events, pid, args.timeout)
        first, last = calls[0][1], calls[-1][1]
        span = max(last - first, 1e-9)
        case.seconds = span
        case.rate = (sum(n for n, _ in calls) - calls[0][0]) / span
        case.cpu = (cpu1 - cpu0) / span
        case.load = os.getloadavg()[0]
        if proc is not None:
            case.in_worker = _platform_in_worker(proc)
    finally:
        if host is not None:
            host.stop_quietly()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        _stop(emulator, False)
        if table:
            with engine.begin() as conn:
                conn.execute(sa.text(f'DROP TABLE IF EXISTS "{table}"'))  # a name this script made
        engine.dispose()
    return case


# ---- the platform contestant: a child process --------------------------------------------------


def _start_platform(app: AppDir, queue: str, cardinality: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    from tests.app.test_platform_launch import RUNTIME_PACKAGES, _pip_target

    site = _pip_target(RUNTIME_PACKAGES)  # the tests' cache: installed once, then reused
    full_env = {k: v for k, v in os.environ.items() if k not in app.settings}  # local.settings.json decides
    full_env.update(env)
    full_env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}"
    function = "work_" + queue.replace("-", "_")
    cmd = [sys.executable, __file__, "--platform-child", str(app.root), "--site", str(site), "--function", function]
    cmd += ["--queue", queue, "--cardinality", cardinality]
    log = (app.root / "platform.log").open("wb")
    stats = (app.root / "platform-stats.json").open("wb")
    proc = subprocess.Popen(cmd, cwd=app.root, env=full_env, stdout=stats, stderr=log)
    log.close()
    stats.close()
    return proc


def _platform_in_worker(proc: subprocess.Popen[bytes]) -> float:
    """The child's events a second over its conversion and call time (it writes them when drained)."""
    assert isinstance(proc.args, list)
    stats = Path(str(proc.args[proc.args.index("--platform-child") + 1])) / "platform-stats.json"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = stats.read_text().strip() if stats.exists() else ""
        if text:
            doc = json.loads(text)
            return float(doc["events"]) / max(float(doc["invoke_seconds"]), 1e-9)
        time.sleep(0.05)
    return float("nan")


class _Data:
    """The host's ``TypedData``: one field of the ``data`` oneof set (no base64: the value as sent)."""

    def __init__(self, kind: str, value: object) -> None:
        self._kind = kind
        setattr(self, kind, value)

    def WhichOneof(self, group: str) -> str:  # the protobuf API
        return self._kind


class _Param:
    """The host's ``ParameterBinding``."""

    def __init__(self, name: str, data: _Data) -> None:
        self.name, self.data = name, data

    def WhichOneof(self, group: str) -> str:  # the protobuf API
        return "data"


def _props(msg: Any) -> dict[str, Any]:
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in (msg.application_properties or {}).items()}  # fmt: skip


def _metadata_one(msg: Any) -> dict[str, _Data]:
    """What the host sends beside one message (system properties: strings, JSON for numbers and maps)."""
    properties = json.dumps(_props(msg))
    return {
        "MessageId": _Data("string", str(msg.message_id)),
        "DeliveryCount": _Data("json", json.dumps(msg.delivery_count + 1)),  # the host counts from 1
        "EnqueuedTimeUtc": _Data("string", msg.enqueued_time_utc.isoformat()),
        "SequenceNumber": _Data("json", json.dumps(msg.sequence_number)),
        "ContentType": _Data("string", str(msg.content_type)),
        "ApplicationProperties": _Data("json", properties),
        "UserProperties": _Data("json", properties),
    }


def _metadata_many(msgs: list[Any]) -> dict[str, _Data]:
    """... and beside a batch: the same properties as JSON arrays (the SDK tells ``many`` by them)."""
    properties = json.dumps([_props(m) for m in msgs])
    return {
        "MessageIdArray": _Data("json", json.dumps([str(m.message_id) for m in msgs])),
        "DeliveryCountArray": _Data("json", json.dumps([m.delivery_count + 1 for m in msgs])),
        "EnqueuedTimeUtcArray": _Data("json", json.dumps([m.enqueued_time_utc.isoformat() for m in msgs])),
        "SequenceNumberArray": _Data("json", json.dumps([m.sequence_number for m in msgs])),
        "ContentTypeArray": _Data("json", json.dumps([str(m.content_type) for m in msgs])),
        "ApplicationPropertiesArray": _Data("json", properties),
        "UserPropertiesArray": _Data("json", properties),
    }


def platform_child(args: argparse.Namespace) -> None:
    """Index the app with azure-functions-runtime, then drain the queue through its conversion."""
    app = Path(args.platform_child)
    sys.path.insert(0, str(app))
    sys.path.insert(1, args.site)
    os.chdir(app)
    meta = importlib.import_module("azure_functions_runtime.bindings.meta")
    registry_module = importlib.import_module("azure_functions_runtime.functions")
    loader = importlib.import_module("azure_functions_runtime.loader")
    from tests.app.platform_judge import PROTOS

    meta.load_binding_registry()
    registry = registry_module.Registry()
    infos = {}
    for function in loader.index_function_app(str(app / "function_app.py")):
        infos[function.get_function_name()] = registry.add_indexed_function(function, PROTOS)
    info = infos[args.function]
    ((name, param),) = info.input_types.items()
    host = json.loads((app / "host.json").read_text())["extensions"]["serviceBus"]
    many = args.cardinality == "many"
    batch_size = int(host.get("maxMessageBatchSize", 1000))
    pool = ThreadPoolExecutor(int(host.get("maxConcurrentCalls", 16)))
    invoke_seconds = 0.0
    events = 0

    def call(data: _Data, metadata: dict[str, _Data]) -> None:
        value = meta.from_incoming_proto(
            param.binding_name,
            _Param(name, data),
            trigger_metadata=metadata,
            pytype=param.pytype,
            function_name=info.name,
        )
        info.func(**{name: value})

    from azure.servicebus import ServiceBusClient

    from dbfanout.host.batch_receive import SOCKET_TIMEOUT_SECONDS, receive_batch
    from shared.messages import PROP_EVENT_COUNT

    connection = json.loads((app / "local.settings.json").read_text())["Values"]["DBFANOUT_SERVICEBUS"]
    idle_since = time.monotonic()
    with (
        ServiceBusClient.from_connection_string(connection) as client,
        client.get_queue_receiver(args.queue, socket_timeout=SOCKET_TIMEOUT_SECONDS) as receiver,
    ):
        while time.monotonic() - idle_since < 5.0:  # drained: nothing for 5 s
            msgs = receive_batch(receiver, batch_size if many else FETCH, 1.0)
            if not msgs:
                continue
            idle_since = time.monotonic()
            events += sum(int(_props(m).get(PROP_EVENT_COUNT, 0)) for m in msgs)
            started = time.perf_counter()  # the wall time from the first conversion to the last call's end
            if many:
                call(_Data("collection_bytes", types.SimpleNamespace(bytes=[b"".join(m.body) for m in msgs])),
                     _metadata_many(msgs))  # fmt: skip
            else:
                futures = [pool.submit(call, _Data("bytes", b"".join(m.body)), _metadata_one(m)) for m in msgs]
                for future in futures:
                    future.result()
            invoke_seconds += time.perf_counter() - started
            for m in msgs:
                receiver.complete_message(m)
            print(json.dumps({"events": events, "invoke_seconds": invoke_seconds}), file=sys.stderr, flush=True)
    pool.shutdown()
    print(json.dumps({"events": events, "invoke_seconds": invoke_seconds}), flush=True)


# ---- the table ---------------------------------------------------------------------------------

HEADER = (
    f"{'contestant':<10} {'cardinality':<11} {'handler':<7} {'messages':>8} {'events':>7}"
    f" {'seconds':>8} {'events/s':>9} {'in worker':>10} {'cpu':>5} {'load':>5}"
)


def _row(c: Case) -> str:
    return (
        f"{c.contestant:<10} {c.cardinality:<11} {c.handler:<7} {c.messages:>8} {c.events:>7}"
        f" {c.seconds:>8.2f} {c.rate:>9.0f} {c.in_worker:>10.0f} {c.cpu:>5.2f} {c.load:>5.2f}"
    )


def _words(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--contestant", type=_words, default=["platform", "local"], help="comma list: platform,local")
    parser.add_argument("--cardinality", type=_words, default=["one", "many"], help="comma list: one,many")
    parser.add_argument("--handler", type=_words, default=["noop", "pg"], help="comma list: noop,pg")
    parser.add_argument("--messages", type=int, default=500, help="messages prefilled per case")
    parser.add_argument("--events", type=int, default=100, help="events per message")
    parser.add_argument("--db-url", default=PG_URL, help="PostgreSQL for the pg handler's ProcessedEvents table")
    parser.add_argument("--timeout", type=float, default=300.0, help="give a case at most this long to drain")
    parser.add_argument("--json", action="store_true", help="print the cases as JSON")
    parser.add_argument("--platform-child", help=argparse.SUPPRESS)  # internal: the platform contestant
    parser.add_argument("--site", help=argparse.SUPPRESS)
    parser.add_argument("--function", help=argparse.SUPPRESS)
    parser.add_argument("--queue", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.platform_child:
        args.cardinality = args.cardinality[0]
        platform_child(args)
        return
    unknown = (
        set(args.contestant) - {"platform", "local"}
        | set(args.cardinality) - {"one", "many"}
        | set(args.handler) - {"noop", "pg"}
    )
    if unknown:
        sys.exit(f"unknown --contestant/--cardinality/--handler values: {sorted(unknown)}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-worker-"))
    azurite = start_azurite()
    cases: list[Case] = []
    print(f"load={os.getloadavg()[0]:.2f} cores={os.cpu_count()}", file=sys.stderr, flush=True)
    print(HEADER, file=sys.stderr, flush=True)
    try:
        n = 0
        for handler in args.handler:
            for cardinality in args.cardinality:
                for contestant in args.contestant:
                    n += 1
                    cases.append(
                        run_case(contestant, cardinality, handler, args, tmp / str(n), azurite.connection_string)
                    )
                    print(_row(cases[-1]), file=sys.stderr, flush=True)
    finally:
        azurite.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps([{k: None if v != v else v for k, v in asdict(c).items()} for c in cases], indent=2))
        return
    print(f"load average {os.getloadavg()}, {os.cpu_count()} cores; rates in events/s, CPU in s/s (lower bounds)")
    print(HEADER)
    for c in cases:
        print(_row(c))


if __name__ == "__main__":
    main()
