"""The local host serves an app like the Functions host: message shape, settlement, locks, timers.

Each test writes a tiny app module into its own folder and runs it with :class:`LocalHost` in
this process, so it can look at exactly what the functions received.
"""

from __future__ import annotations

import datetime as dt
import itertools
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from typer.testing import CliRunner

from dbfanout.host import LocalHost
from sbemulator import Emulator
from sbemulator.testing import unique_queue
from tests.host.app_support import wait_for
from tests.support.ports import wait_until

APP = """
import threading, time
import azure.functions as func

app = func.FunctionApp()
RECEIVED = []
RECEIVED_AT = []
BATCHES = []
BATCHES_AT = []
FINISHED = []
TICKS = []
ACTIVE = {"now": 0, "max": 0}
_lock = threading.Lock()

@app.function_name("shape")
@app.service_bus_queue_trigger(arg_name="msg", connection="SHAPE_SB", queue_name="%SHAPE_QUEUE%")
def shape(msg: func.ServiceBusMessage) -> None:
    RECEIVED_AT.append(time.monotonic())
    RECEIVED.append(msg)
    props = msg.application_properties
    if props.get("fail_first") and msg.delivery_count == 1:
        raise RuntimeError("the first delivery fails")
    time.sleep(float(props.get("sleep", 0)))
    FINISHED.append(msg.message_id)

@app.function_name("batch")
@app.service_bus_queue_trigger(
    arg_name="msgs", connection="SHAPE_SB", queue_name="%SHAPE_BATCH_QUEUE%", cardinality=func.Cardinality.MANY
)
def batch(msgs: list) -> None:
    BATCHES_AT.append(time.monotonic())
    BATCHES.append(list(msgs))

@app.function_name("clock")
@app.timer_trigger(arg_name="timer", schedule="%SHAPE_SCHEDULE%", use_monitor=False)
def clock(timer: func.TimerRequest) -> None:
    with _lock:
        ACTIVE["now"] += 1
        ACTIVE["max"] = max(ACTIVE["max"], ACTIVE["now"])
    TICKS.append((time.time(), timer))
    time.sleep(1.3 if len(TICKS) == 1 else 0)  # the first tick overruns the next occurrence
    with _lock:
        ACTIVE["now"] -= 1
"""


def _write_app(root: Path) -> str:
    name = f"shape_app_{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}.py").write_text(textwrap.dedent(APP))
    return name


@pytest.fixture
def client(servicebus: Emulator) -> Iterator[ServiceBusClient]:
    with ServiceBusClient.from_connection_string(servicebus.connection_string, retry_total=0) as c:
        yield c


class Running:
    def __init__(self, host: LocalHost, module: ModuleType, queue: str, batch_queue: str) -> None:
        self.host, self.module, self.queue, self.batch_queue = host, module, queue, batch_queue

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


@pytest.fixture
def running(
    tmp_path: Path, servicebus: Emulator, restore_environ: None, request: pytest.FixtureRequest
) -> Iterator[Running]:
    lock = getattr(request, "param", "PT30S")
    queue = unique_queue(servicebus, "shape", lock_duration=lock, max_delivery_count=5)
    batch_queue = unique_queue(servicebus, "batch")
    name = _write_app(tmp_path)
    settings = {
        "SHAPE_SB": servicebus.connection_string,
        "SHAPE_QUEUE": queue,
        "SHAPE_BATCH_QUEUE": batch_queue,
        "SHAPE_SCHEDULE": "*/1 * * * * *",
    }
    host = LocalHost(tmp_path, f"{name}:app", extra_settings=settings, grace_seconds=10)
    host.start()
    import sys

    try:
        yield Running(host, sys.modules[name], queue, batch_queue)
    finally:
        host.stop()


@pytest.mark.integration
def test_functions_receive_messages_filled_like_the_host_fills_them(
    running: Running, client: ServiceBusClient, servicebus: Emulator
) -> None:
    # Given a message with properties whose first delivery fails
    sent_at = dt.datetime.now(dt.UTC)
    with client.get_queue_sender(running.queue) as sender:
        sender.send_messages(
            ServiceBusMessage(
                b'{"hello": 1}',
                message_id="m-1",
                content_type="application/json",
                correlation_id="corr-1",
                subject="orders",
                application_properties={"fail_first": True, "poller": "orders", "events": 3},
            )
        )
    # When the host delivers it, the function fails, and the host abandons it
    wait_for(lambda: len(running.FINISHED) == 1, 30, "the second delivery to succeed")
    first, second = running.RECEIVED
    # Then the function saw a func.ServiceBusMessage like on Azure, counting deliveries from 1
    assert [first.delivery_count, second.delivery_count] == [1, 2]
    assert second.get_body() == b'{"hello": 1}'
    assert second.message_id == "m-1"
    assert second.content_type == "application/json"
    assert second.correlation_id == "corr-1"
    assert second.label == "orders" and second.subject == "orders"
    assert second.application_properties == {"fail_first": True, "poller": "orders", "events": 3}
    assert second.user_properties == second.application_properties
    assert second.sequence_number == first.sequence_number and second.sequence_number is not None
    assert second.enqueued_time_utc is not None
    assert abs((second.enqueued_time_utc - sent_at).total_seconds()) < 30
    assert second.lock_token and second.locked_until is not None and second.locked_until > second.enqueued_time_utc
    assert second.expires_at_utc is not None and second.expires_at_utc > second.enqueued_time_utc
    assert second.metadata["DeliveryCount"] == 2 and second.metadata["MessageId"] == "m-1"
    # And success completed it (autoComplete): nothing is left on the queue
    wait_for(lambda: servicebus.queue_stats(running.queue)["messages"] == 0, 10, "the completion")


def _received(running: Running, n: int) -> bool:
    return len(running.RECEIVED_AT) >= n


@pytest.mark.integration
def test_a_message_reaches_its_function_within_milliseconds_of_its_send(
    running: Running, client: ServiceBusClient
) -> None:
    # Given an idle single-message function (its receive waits for the next message)
    latencies: list[float] = []
    with client.get_queue_sender(running.queue) as sender:
        sender.send_messages(ServiceBusMessage(b"warm-up"))
        wait_for(lambda: len(running.RECEIVED) == 1, 30, "the warm-up message")
        # When messages are sent one at a time
        for i in range(2, 10):
            sender.send_messages(ServiceBusMessage(f"m{i}".encode()))
            sent = time.monotonic()
            wait_until(partial(_received, running, i), 10, "the message", interval=0.001)
            latencies.append(running.RECEIVED_AT[-1] - sent)
    # Then each reaches the function at once: no batching wait after the first message arrives
    latencies.sort()
    assert latencies[len(latencies) // 2] < 0.1, latencies  # was 0.2 s: the SDK's further pull
    assert latencies[-1] < 0.5, latencies


@pytest.mark.integration
def test_cardinality_many_gets_a_list_of_messages(running: Running, client: ServiceBusClient) -> None:
    with client.get_queue_sender(running.batch_queue) as sender:
        sender.send_messages([ServiceBusMessage(f"m{i}", message_id=f"b-{i}") for i in range(5)])
    wait_for(lambda: sum(len(b) for b in running.BATCHES) == 5, 30, "five messages in batches")
    ids = sorted(m.message_id for b in running.BATCHES for m in b)
    assert ids == [f"b-{i}" for i in range(5)]
    assert all(m.delivery_count == 1 for b in running.BATCHES for m in b)


def _batches(running: Running, n: int) -> bool:
    return len(running.BATCHES_AT) >= n


@pytest.mark.integration
def test_a_batch_function_gets_a_lone_message_within_the_extensions_fill_window(
    running: Running, client: ServiceBusClient
) -> None:
    # Given an idle cardinality-many function
    latencies: list[float] = []
    with client.get_queue_sender(running.batch_queue) as sender:
        sender.send_messages(ServiceBusMessage(b"warm-up"))
        wait_for(partial(_batches, running, 1), 30, "the warm-up batch")
        # When messages are sent one at a time
        for i in range(2, 10):
            sender.send_messages(ServiceBusMessage(f"m{i}".encode()))
            sent = time.monotonic()
            wait_until(partial(_batches, running, i), 10, "the batch", interval=0.001)
            latencies.append(running.BATCHES_AT[-1] - sent)
        # Then each is handed over after at most the extension's 20 ms fill wait, not the Python
        # SDK's 0.2 s further pull (every call took >= 0.2 s before)
        latencies.sort()
        assert latencies[len(latencies) // 2] < 0.1, latencies
        # And a backlog still arrives in batches: twenty messages on the queue at once take fewer calls
        calls = len(running.BATCHES)
        sender.send_messages([ServiceBusMessage(f"b{i}", message_id=f"backlog-{i}") for i in range(20)])
    wait_for(lambda: sum(len(b) for b in running.BATCHES[calls:]) == 20, 30, "the backlog")
    assert len(running.BATCHES) - calls < 20, [len(b) for b in running.BATCHES[calls:]]


@pytest.mark.integration
@pytest.mark.parametrize("running", ["PT4S"], indirect=True)
def test_locks_are_renewed_while_a_slow_function_runs(
    running: Running, client: ServiceBusClient, servicebus: Emulator
) -> None:
    # Given a 4-second lock and a function that takes 9 seconds: it needs at least two renewals.
    # (A 4 s lock renewed at 2 s remaining leaves room for the first renewal, which also opens the
    # $management link, on a loaded 2-core machine.)
    with client.get_queue_sender(running.queue) as sender:
        sender.send_messages(ServiceBusMessage(b"slow", message_id="slow-1", application_properties={"sleep": 9.0}))
    # When it runs to the end
    wait_for(lambda: running.FINISHED == ["slow-1"], 30, "the slow call")
    wait_for(lambda: servicebus.queue_stats(running.queue)["messages"] == 0, 10, "the completion")
    # Then the lock never lapsed: one delivery, completed
    assert [m.delivery_count for m in running.RECEIVED] == [1]


@pytest.mark.integration
def test_stop_lets_a_running_call_finish_and_settles_it(
    running: Running, client: ServiceBusClient, servicebus: Emulator
) -> None:
    with client.get_queue_sender(running.queue) as sender:
        sender.send_messages(ServiceBusMessage(b"x", message_id="inflight", application_properties={"sleep": 2.0}))
    wait_for(lambda: len(running.RECEIVED) == 1, 30, "the call to start")
    # When the host stops while the call runs
    running.host.stop()
    # Then the call finished and its message was completed, not left to a lock expiry
    assert running.FINISHED == ["inflight"]
    assert servicebus.queue_stats(running.queue)["messages"] == 0


@pytest.mark.integration
def test_timers_fire_on_schedule_and_never_overlap(running: Running) -> None:
    wait_for(lambda: len(running.TICKS) >= 3, 20, "three ticks")
    assert running.ACTIVE["max"] == 1
    times = [t for t, _ in running.TICKS]
    assert all(b - a >= 0.5 for a, b in itertools.pairwise(times))
    first = running.TICKS[0][1]
    assert first.past_due is False
    assert set(first.schedule_status) == {"Last", "Next", "LastUpdated"}


def test_run_is_mounted_on_the_cli() -> None:
    from dbfanout.cli import app

    result = CliRunner().invoke(app, ["run", "--help"])
    assert result.exit_code == 0
    for option in ("--config", "--app", "--app-root", "--duration"):
        assert option in result.output


def test_a_bad_schedule_stops_dbfanout_run_with_the_function_named(tmp_path: Path, restore_environ: None) -> None:
    from dbfanout.cli import app

    (tmp_path / "bad_app.py").write_text(
        "import azure.functions as func\napp = func.FunctionApp()\n"
        "@app.timer_trigger(arg_name='t', schedule='*/5 * * * *')\ndef tick(t) -> None:\n    pass\n"
    )
    result = CliRunner().invoke(app, ["run", "--app-root", str(tmp_path), "--app", "bad_app:app", "--duration", "1"])
    assert result.exit_code == 2
    assert "tick.schedule" in result.output and "six-field" in result.output


def test_stop_closes_what_the_functions_hold() -> None:
    from dbfanout.host.app_loader import FunctionSpec
    from dbfanout.host.host import _closure_closables

    class Part:
        closed = False

        def close(self) -> None:
            self.closed = True

    part = Part()

    def fn(t: object) -> None:
        part.close  # noqa: B018 - captures ``part`` in the closure like function_app's blueprints

    spec = FunctionSpec("f", {"type": "timerTrigger", "name": "t"}, fn)
    assert list(_closure_closables([spec, spec])) == [part]


def _run_in(folder: Path) -> subprocess.CompletedProcess[str]:
    """``dbfanout run`` started in ``folder`` as a user starts it (a fresh process: nothing imported)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBFANOUT_")}
    return subprocess.run(
        [sys.executable, "-m", "dbfanout.cli", "run", "--duration", "1"],
        cwd=folder, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_run_without_function_app_says_to_init_the_folder(tmp_path: Path) -> None:
    # Given an empty folder (issue 40: the hint was "pass --app-root DIR", which is not the fix)
    # When dbfanout run starts there
    result = _run_in(tmp_path)
    # Then it fails as bad configuration and says how to make the folder an app
    assert result.returncode == 2, result.stderr
    assert "dbfanout init" in result.stderr and "not a dbfanout app" in result.stderr


def test_run_in_an_app_folder_missing_function_app_says_init_writes_it(tmp_path: Path) -> None:
    # Given a folder with a dbfanout.toml but no function_app.py
    (tmp_path / "dbfanout.toml").write_text('[app]\nname = "x"\n')
    # When dbfanout run starts there
    result = _run_in(tmp_path)
    # Then the hint is that init writes the missing entry point
    assert result.returncode == 2, result.stderr
    assert "dbfanout init" in result.stderr and "function_app.py" in result.stderr
