"""The local host serves session-enabled triggers like the Functions host (issue 13).

One session per call, in order within a session (an abandoned message comes back before the next
one), at most ``maxConcurrentSessions`` sessions at once, and the session lock renewed while a
slow call runs. A tiny app runs in this process with :class:`LocalHost` against the emulator.
"""

from __future__ import annotations

import json
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage

from dbfanout.host import LocalHost
from sbemulator import Emulator
from sbemulator.testing import unique_queue
from tests.host.app_support import wait_for

pytestmark = pytest.mark.integration

APP = """
import threading, time
import azure.functions as func

app = func.FunctionApp()
SEEN = []      # (session, seq, delivery count) in call order
DONE = []      # (session, seq) of calls that succeeded, in order
BATCHES = []   # the session ids of each batch call
ACTIVE = {"now": 0, "max": 0}
_lock = threading.Lock()

@app.function_name("ordered")
@app.service_bus_queue_trigger(
    arg_name="msg", connection="SESSION_SB", queue_name="%SESSION_QUEUE%", is_sessions_enabled=True
)
def ordered(msg: func.ServiceBusMessage) -> None:
    props = msg.application_properties
    key = (msg.session_id, props["seq"])
    with _lock:
        SEEN.append((*key, msg.delivery_count))
        ACTIVE["now"] += 1
        ACTIVE["max"] = max(ACTIVE["max"], ACTIVE["now"])
    try:
        time.sleep(float(props.get("sleep", 0)))
        if props.get("fail_first") and msg.delivery_count == 1:
            raise RuntimeError("the first delivery fails")
        with _lock:
            DONE.append(key)
    finally:
        with _lock:
            ACTIVE["now"] -= 1

@app.function_name("ordered_batch")
@app.service_bus_queue_trigger(
    arg_name="msgs",
    connection="SESSION_SB",
    queue_name="%SESSION_BATCH_QUEUE%",
    is_sessions_enabled=True,
    cardinality=func.Cardinality.MANY,
)
def ordered_batch(msgs: list) -> None:
    BATCHES.append([m.session_id for m in msgs])
"""


class Running:
    def __init__(self, host: LocalHost, module: ModuleType, queue: str, batch_queue: str) -> None:
        self.host, self.module, self.queue, self.batch_queue = host, module, queue, batch_queue


@pytest.fixture
def running(
    tmp_path: Path, servicebus: Emulator, restore_environ: None, request: pytest.FixtureRequest
) -> Iterator[Running]:
    lock = getattr(request, "param", "PT30S")
    queue = unique_queue(servicebus, "sess", requires_session=True, lock_duration=lock, max_delivery_count=5)
    batch_queue = unique_queue(servicebus, "sessbatch", requires_session=True)
    name = f"session_app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(APP))
    service_bus = {"maxConcurrentSessions": 2, "sessionIdleTimeout": "00:00:01", "maxMessageBatchSize": 50}
    (tmp_path / "host.json").write_text(json.dumps({"version": "2.0", "extensions": {"serviceBus": service_bus}}))
    settings = {"SESSION_SB": servicebus.connection_string, "SESSION_QUEUE": queue, "SESSION_BATCH_QUEUE": batch_queue}
    host = LocalHost(tmp_path, f"{name}:app", extra_settings=settings, grace_seconds=10)
    host.start()
    try:
        yield Running(host, sys.modules[name], queue, batch_queue)
    finally:
        host.stop()


@pytest.fixture
def client(servicebus: Emulator) -> Iterator[ServiceBusClient]:
    with ServiceBusClient.from_connection_string(servicebus.connection_string, retry_total=0) as c:
        yield c


def test_a_session_is_served_in_order_one_call_at_a_time_and_redeliveries_keep_their_place(
    running: Running, client: ServiceBusClient, servicebus: Emulator
) -> None:
    # Given four sessions of five messages each, where messages 1 and 3 fail their first delivery
    sessions = [f"key-{n}" for n in range(4)]
    with client.get_queue_sender(running.queue) as sender:
        for seq in range(5):
            sender.send_messages(
                [
                    ServiceBusMessage(
                        f"{s}/{seq}",
                        session_id=s,
                        application_properties={"seq": seq, "fail_first": seq in (1, 3), "sleep": 0.2},
                    )
                    for s in sessions
                ]
            )
    # When the host serves them
    wait_for(lambda: len(running.module.DONE) == 20, 90, "every message to succeed")
    wait_for(lambda: servicebus.queue_stats(running.queue)["messages"] == 0, 10, "the completions")
    # Then within each session the calls came in order, each failed message again before the next
    for s in sessions:
        calls = [(seq, count) for session, seq, count in running.module.SEEN if session == s]
        assert calls == [(0, 1), (1, 1), (1, 2), (2, 1), (3, 1), (3, 2), (4, 1)], s
    # And sessions ran side by side, never more than maxConcurrentSessions (2) calls at once
    assert running.module.ACTIVE["max"] == 2


def test_a_batch_call_holds_messages_of_one_session(running: Running, client: ServiceBusClient) -> None:
    with client.get_queue_sender(running.batch_queue) as sender:
        sender.send_messages([ServiceBusMessage(f"m{i}", session_id=f"s{i % 3}") for i in range(30)])
    wait_for(lambda: sum(len(b) for b in running.module.BATCHES) == 30, 60, "thirty messages in batches")
    assert all(len(set(batch)) == 1 for batch in running.module.BATCHES), running.module.BATCHES


@pytest.mark.parametrize("running", ["PT4S"], indirect=True)
def test_the_session_lock_is_renewed_while_a_slow_call_runs(
    running: Running, client: ServiceBusClient, servicebus: Emulator
) -> None:
    # Given a 4-second session lock and a first message whose call takes 9 seconds
    with client.get_queue_sender(running.queue) as sender:
        sender.send_messages(
            [
                ServiceBusMessage("slow", session_id="slow", application_properties={"seq": 0, "sleep": 9.0}),
                ServiceBusMessage("next", session_id="slow", application_properties={"seq": 1}),
            ]
        )
    # When both are handled
    wait_for(lambda: len(running.module.DONE) == 2, 60, "both calls")
    wait_for(lambda: servicebus.queue_stats(running.queue)["messages"] == 0, 10, "the completions")
    # Then the session lock never lapsed: one delivery each, in order
    assert running.module.SEEN == [("slow", 0, 1), ("slow", 1, 1)]
