"""A refusing broker is a state (poller/tick/backoff.py): the backoff schedule, the log-once state and
the tick against the real emulator with a full queue and a throttling namespace.

The tick tests use a SQLite source, the in-memory state store (it counts the writes that land)
and the real Service Bus sink on the project's emulator, whose ``faults.send_counts`` counts the
transfers it refused. Time is a fake monotonic clock: a tick "inside the backoff window" is one
whose clock has not reached the next attempt.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from azure.servicebus import ServiceBusClient
from hypothesis import given
from hypothesis import strategies as st

from poller.lease.keeper import StickyLease
from poller.sinks.servicebus import ServiceBusSink
from poller.sinks.storagequeue import StorageQueueSink
from poller.sources.keyset.source import SqlSource
from poller.state.memory import MemoryStateStore
from poller.tick.backoff import METADATA_KEY, BackoffSchedule, RefusalBackoff, SinkRefusals
from poller.tick.lifecycle import run_tick
from sbemulator import Emulator
from sbemulator.testing import unique_queue
from shared.errors import BrokerRefusingError
from shared.models import Batch, Checkpoint, Position, RowChange
from shared.servicebus import QueueSender
from shared.settings import StorageConnection
from shared.storagequeue import StorageQueueSender, queue_service_client
from shared.telemetry import metrics
from tests.poller.conftest import FakeClock
from tests.poller.tick_support import RecordingSink, SourceTable, make_poller
from tests.support import otel
from tests.support.azurite import Azurite
from tests.support.faultproxy import FaultProxy
from tests.support.ports import wait_until

# -- the schedule ------------------------------------------------------------------------------


@given(attempt=st.integers(1, 10_000), seed=st.integers(0, 2**32))
def test_each_delay_lies_in_the_upper_half_of_its_nominal_and_never_above_the_cap(attempt: int, seed: int) -> None:
    schedule = BackoffSchedule()
    delay = schedule.delay(attempt, random.Random(seed))
    assert schedule.nominal(attempt) / 2 <= delay <= schedule.nominal(attempt) <= schedule.cap


@given(attempt=st.integers(1, 200))
def test_the_nominal_delay_doubles_from_the_base_until_the_cap(attempt: int) -> None:
    schedule = BackoffSchedule(base=1.0, cap=30.0)
    assert schedule.nominal(1) == 1.0
    assert schedule.nominal(attempt + 1) == min(30.0, 2 * schedule.nominal(attempt))


@given(window=st.floats(1.0, 3600.0), seed=st.integers(0, 2**32))
def test_attempts_in_a_window_grow_logarithmically_then_linearly_at_the_cap(window: float, seed: int) -> None:
    # Given a refusal that lasts `window` seconds; When every attempt waits its drawn delay
    schedule, rng = BackoffSchedule(base=1.0, cap=30.0), random.Random(seed)
    elapsed, attempts = 0.0, 1
    while (elapsed := elapsed + schedule.delay(attempts, rng)) <= window:
        attempts += 1
    # Then at most ~log2 of the window while below the cap, then one per cap/2 at most
    below_cap = 6  # 0.5+1+2+4+8 s before the nominal delay reaches 30 s
    assert attempts <= below_cap + 1 + window / (schedule.cap / 2)
    if window >= 60:  # a poller on a 1 s timer tried once per tick before: 60+ times a minute
        assert attempts <= window / 4


# -- the state ---------------------------------------------------------------------------------


class Monotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _refusal(reason: str = "queue_full") -> BrokerRefusingError:
    return BrokerRefusingError(f"send to queue q refused: {reason} (test)", reason)  # type: ignore[arg-type]


def test_a_refusal_warns_once_then_debug_and_its_end_once_at_info(caplog: pytest.LogCaptureFixture) -> None:
    mono, clock = Monotonic(), FakeClock()
    refusals = SinkRefusals("p-state", monotonic=mono, clock=clock, rng=random.Random(1))
    with caplog.at_level(logging.DEBUG, logger="dbfanout"):
        # Given three refused sends in a row
        assert refusals.refused(_refusal()) is True  # the start: the caller persists it
        first_wait = refusals.wait_seconds()
        mono.now += first_wait
        assert refusals.refused(_refusal()) is False and refusals.refused(_refusal()) is False
        # Then the waits grow, one WARNING was written, the gauge says refusing
        assert 0.5 <= first_wait <= 1.0 and refusals.wait_seconds() >= 1.0
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "queue is full" in warnings[0].getMessage()
        assert metrics.sink_refusing.get({"poller": "p-state"}) == 1
        assert refusals.metadata()["reason"] == "queue_full"
        # When a send is accepted and the tick ends, 30 s after the start
        clock.advance(30)
        refusals.accepted(10)
        refusals.tick_ended(caught_up=True)
    # Then one INFO line says how long it lasted and how many rows had waited
    [ended] = [r for r in caplog.records if "accepts sends again" in r.getMessage()]
    assert ended.levelno == logging.INFO and "30.0 s" in ended.getMessage() and "10 rows" in ended.getMessage()
    assert not refusals.refusing and refusals.wait_seconds() == 0
    assert metrics.sink_refusing.get({"poller": "p-state"}) == 0


def test_a_refusal_another_process_recorded_is_adopted_without_a_new_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    refusals = SinkRefusals("p-adopt", monotonic=Monotonic(), clock=clock)
    since = clock.now - dt.timedelta(minutes=5)
    # Given a checkpoint whose metadata says the broker has refused for 5 minutes
    refusals.adopt({METADATA_KEY: {"since": since.isoformat(), "reason": "throttled", "error": "busy"}})
    with caplog.at_level(logging.DEBUG, logger="dbfanout"):
        # When this process is refused too, then accepted
        assert refusals.refused(_refusal("throttled")) is False  # not a new refusal: nothing to persist
        refusals.accepted(3)
        refusals.tick_ended(caught_up=True)
    # Then no WARNING, and the end reports the refusal's whole duration
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    [ended] = [r for r in caplog.records if "accepts sends again" in r.getMessage()]
    assert "300.0 s" in ended.getMessage()


def test_the_sink_decorator_marks_a_refusal_once_and_counts_what_the_inner_sink_accepted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given the refusal backoff around a sink, and a checkpoint a tick loaded
    inner = RecordingSink()
    sink = RefusalBackoff(inner, SinkRefusals("p-wrap", monotonic=Monotonic(), clock=FakeClock()))
    loaded = Checkpoint(
        position=Position(cursor=7, pk={"id": 7}), last_successful_batch_id="b7", metadata={"row_count": 1}
    )
    batch = Batch(poller="p-wrap", batch_id="b8", source_fingerprint="f", events=(_event(8), _event(9)))
    with caplog.at_level(logging.DEBUG, logger="dbfanout"):
        # When the broker refuses twice, then the inner sink accepts a batch and the tick ends
        marked = sink.refused(_refusal(), loaded)
        assert sink.refused(_refusal(), loaded) is None  # the refusal goes on: nothing more to write
        sink.send(batch)
        sink.tick_ended(caught_up=True)
    # Then the start was marked once, at the loaded position, with the metadata kept
    assert marked is not None and marked.position == loaded.position
    assert marked.last_successful_batch_id == "b7" and marked.metadata["row_count"] == 1
    assert marked.metadata[METADATA_KEY]["reason"] == "queue_full"
    # And the batch reached the inner sink, and its rows are the ones the end reports
    assert inner.accepted == [batch]
    [ended] = [r for r in caplog.records if "accepts sends again" in r.getMessage()]
    assert "2 rows that had waited" in ended.getMessage()


def _event(i: int) -> RowChange:
    return RowChange(event_id=f"e{i}", op="upsert", pk={"id": i}, cursor=i, after={"id": i}, poller="p-wrap")


def test_a_queue_that_drains_slowly_continues_the_refusal_with_its_backoff_started_over() -> None:
    mono = Monotonic()
    refusals = SinkRefusals("p-slow", monotonic=mono, rng=random.Random(2))
    for _ in range(5):
        refusals.refused(_refusal())
        mono.now += refusals.wait_seconds()
    assert refusals.wait_seconds() == 0 and refusals.schedule.nominal(5) == 16
    # When one page is accepted and the next refused in the same tick
    refusals.accepted(10)
    assert refusals.refused(_refusal()) is False  # no new WARNING
    # Then the next wait is the first attempt's again (capacity appears: try soon)
    assert refusals.wait_seconds() <= 1.0 and refusals.refusing


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@given(st.lists(st.sampled_from(["refused", "accepted", "tick_ended", "wait"]), max_size=60))
def test_any_sequence_warns_once_per_episode_and_ends_each_once(ops: list[str]) -> None:
    # Given any sequence of refused sends, accepted sends, tick ends and waits
    mono = Monotonic()
    refusals = SinkRefusals("p-any", monotonic=mono, clock=FakeClock(), rng=random.Random(5))
    logger, handler = logging.getLogger("dbfanout.poller.backoff"), _Records()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    refusing = progressed = False
    starts = ends = 0
    try:
        for op in ops:
            if op == "refused":
                starts += not refusing
                refusing, progressed = True, False
                refusals.refused(_refusal())
            elif op == "accepted":
                progressed = progressed or refusing
                refusals.accepted(5)
            elif op == "tick_ended":
                if refusing and progressed:
                    refusing, progressed, ends = False, False, ends + 1
                refusals.tick_ended(caught_up=True)
            else:
                mono.now += refusals.wait_seconds()
            # Then the state follows the model, and a wait never exceeds the cap
            assert refusals.refusing == refusing
            assert refusals.wait_seconds() <= refusals.schedule.cap
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    # And each episode logged one WARNING at its start and one INFO line at its end
    assert len([r for r in handler.records if r.levelno == logging.WARNING]) == starts
    assert len([r for r in handler.records if "accepts sends again" in r.getMessage()]) == ends


# -- the tick, against the emulator ------------------------------------------------------------


@pytest.fixture
def table(tmp_path: Path) -> SourceTable:
    return SourceTable(f"sqlite:///{tmp_path / 'src.db'}")


@pytest.fixture
def client(servicebus: Emulator) -> Iterator[ServiceBusClient]:
    with ServiceBusClient.from_connection_string(servicebus.connection_string) as sb:
        yield sb


def _drain_queue(client: ServiceBusClient, queue: str) -> int:
    received = 0
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        while batch := receiver.receive_messages(50, max_wait_time=1):
            for message in batch:
                receiver.complete_message(message)
            received += len(batch)
    return received


@pytest.mark.integration
def test_a_tick_inside_the_backoff_window_sends_nothing_and_writes_nothing(
    table: SourceTable, servicebus: Emulator, client: ServiceBusClient
) -> None:
    # Given a queue that holds a few small messages, and more rows than fit
    queue = unique_queue(servicebus, "tickfull", max_message_size=16 * 1024, max_size_bytes=16 * 1024)
    poller = make_poller(table.engine.url.render_as_string(), queue=queue, batch_size=5)
    source, store = SqlSource(poller), MemoryStateStore("orders")
    sender = QueueSender(client, queue)
    sink = ServiceBusSink(poller, sender)
    mono = Monotonic()
    refusals = SinkRefusals("orders", monotonic=mono, rng=random.Random(3))
    # The lease kept across ticks, as a running app keeps it (poller.lease.keeper.StickyLease)
    lease = StickyLease(store, "a", dt.timedelta(seconds=poller.lease_ttl_seconds), source.fingerprint)
    table.upsert(range(200))

    def tick() -> str:
        return run_tick(poller, source, store, sink, lease=lease, monotonic=mono, refusals=refusals).stop_reason

    try:
        # When the first tick fills the queue
        assert tick() == "sink_refusing"
        refused = servicebus.faults.send_counts(queue)["refused"]
        snap = store.load()
        assert snap is not None
        held = snap.doc.checkpoint
        assert held.metadata[METADATA_KEY]["reason"] == "queue_full"  # written once, at the start
        writes = store.blob.writes
        # Then ticks inside the window send nothing, read nothing and write nothing
        for _ in range(5):
            assert tick() == "sink_refusing"
        assert servicebus.faults.send_counts(queue)["refused"] == refused
        assert store.blob.writes == writes
        # And a tick after the window tries once more, refused again, with no write
        mono.now += refusals.wait_seconds()
        assert tick() == "sink_refusing"
        assert servicebus.faults.send_counts(queue)["refused"] == refused + 1
        assert store.blob.writes == writes
        loaded = store.load()
        assert loaded is not None and loaded.doc.checkpoint.position == held.position

        # When the queue drains and the window passes, ticks deliver every row
        delivered = 0
        for _ in range(60):
            delivered += _drain_queue(client, queue)
            mono.now += refusals.wait_seconds()
            if tick() == "caught_up":
                break
        delivered += _drain_queue(client, queue)
        # Then nothing was lost, and the checkpoint no longer says refusing
        final = store.load()
        assert final is not None and final.doc.checkpoint.position is not None
        assert final.doc.checkpoint.position.pk["id"] == 199
        assert METADATA_KEY not in final.doc.checkpoint.metadata
        assert not refusals.refusing
        assert delivered >= 200 // 5
    finally:
        sink.close()


@pytest.mark.integration
def test_a_throttling_namespace_is_a_refusal_too(
    table: SourceTable, servicebus: Emulator, client: ServiceBusClient
) -> None:
    # Given a throttled queue (the SDK retries ServerBusy itself, then raises)
    queue = unique_queue(servicebus, "busy")
    poller = make_poller(table.engine.url.render_as_string(), queue=queue, batch_size=5)
    source, store = SqlSource(poller), MemoryStateStore("orders")
    fast = ServiceBusClient.from_connection_string(servicebus.connection_string, retry_total=0)
    sink = ServiceBusSink(poller, QueueSender(fast, queue))
    refusals = SinkRefusals("orders")
    table.upsert(range(5))
    servicebus.faults.throttle(queue)
    try:
        # When a tick sends; Then it backs off with the reason "throttled"
        result = run_tick(poller, source, store, sink, owner_id="a", refusals=refusals)
        assert result.stop_reason == "sink_refusing"
        assert refusals.metadata()["reason"] == "throttled"
        assert "entity is being throttled" in refusals.metadata()["error"]
    finally:
        servicebus.faults.unthrottle()
        sink.close()
        fast.close()


@pytest.mark.integration
def test_an_unreachable_storage_queue_is_a_refusal_and_delivery_resumes(table: SourceTable, azurite: Azurite) -> None:
    # Given a storage-queue poller that reaches Azurite's queue endpoint through a proxy
    proxy = FaultProxy(azurite.queue_port)
    conn = StorageConnection(
        connection_string=azurite.connection_string.replace(f":{azurite.queue_port}/", f":{proxy.port}/")
    )
    name = f"sq-{uuid.uuid4().hex[:10]}"
    queue = queue_service_client(conn, retry_total=0).get_queue_client(name)  # refusals surface at once
    poller = make_poller(table.engine.url.render_as_string(), queue=name, batch_size=5, transport="storage-queue")
    sink = StorageQueueSink(poller, StorageQueueSender(queue, create=True))
    source, store = SqlSource(poller), MemoryStateStore("orders")
    refusals = SinkRefusals("orders")
    table.upsert(range(12))
    try:
        # When the account cannot be reached; Then the tick backs off, reason unreachable
        proxy.go_down()
        assert run_tick(poller, source, store, sink, owner_id="a", refusals=refusals).stop_reason == "sink_refusing"
        snap = store.load()
        assert snap is not None and snap.doc.checkpoint.position is None
        assert snap.doc.checkpoint.metadata[METADATA_KEY]["reason"] == "unreachable"
        # When it is back and the window passed; Then every row is sent and the refusal is over
        proxy.come_up()
        wait_until(lambda: refusals.wait_seconds() == 0, 5, "the backoff window to pass")
        result = run_tick(poller, source, store, sink, owner_id="a", refusals=refusals)
        assert result.stop_reason == "caught_up" and result.rows == 12
        assert not refusals.refusing
        assert queue.get_queue_properties().approximate_message_count == 3
    finally:
        proxy.close()
        sink.close()


@pytest.mark.integration
def test_a_lingering_tick_waits_a_refusal_out_within_its_linger(
    table: SourceTable, servicebus: Emulator, client: ServiceBusClient
) -> None:
    # Given a lingering poller whose next two sends the broker refuses (ServerBusy, no SDK retry)
    queue = unique_queue(servicebus, "linger")
    poller = make_poller(table.engine.url.render_as_string(), queue=queue, batch_size=5, linger_seconds=8.0)
    fast = ServiceBusClient.from_connection_string(servicebus.connection_string, retry_total=0)
    sink = ServiceBusSink(poller, QueueSender(fast, queue))
    source, store = SqlSource(poller), MemoryStateStore("orders")
    refusals = SinkRefusals("orders", rng=random.Random(4))
    table.upsert(range(10))
    servicebus.faults.reject_next_sends(2)
    try:
        # When one tick runs; Then it backs off twice inside its linger and delivers every row
        result = run_tick(poller, source, store, sink, owner_id="a", refusals=refusals)
        assert result.rows == 10, result
        assert servicebus.faults.send_counts(queue) == {"accepted": 2, "refused": 2}
        assert not refusals.refusing
        snap = store.load()
        assert snap is not None and snap.doc.checkpoint.position is not None
        assert snap.doc.checkpoint.position.pk["id"] == 9 and METADATA_KEY not in snap.doc.checkpoint.metadata
    finally:
        sink.close()
        fast.close()


@pytest.mark.integration
def test_refused_sends_are_exported_by_reason_and_the_gauge_follows_the_refusal(
    table: SourceTable, servicebus: Emulator
) -> None:
    # Given the OpenTelemetry SDK, and a throttled queue
    otel.install()
    poller_name = f"p-{uuid.uuid4().hex[:8]}"
    queue = unique_queue(servicebus, "metrics")
    poller = make_poller(table.engine.url.render_as_string(), name=poller_name, queue=queue, batch_size=5)
    fast = ServiceBusClient.from_connection_string(servicebus.connection_string, retry_total=0)
    sink = ServiceBusSink(poller, QueueSender(fast, queue))
    source, store = SqlSource(poller), MemoryStateStore(poller_name)
    refusals = SinkRefusals(poller_name)
    table.upsert(range(5))
    servicebus.faults.throttle(queue)

    def gauge() -> float | None:
        found = [
            p.value for attrs, p in otel.points().get("dbfanout.sink_refusing", []) if attrs == {"poller": poller_name}
        ]
        return found[-1] if found else None

    try:
        # When a tick is refused; Then one refused send is counted by reason, the gauge is 1,
        # and no tick failure is counted (a refusal is not a failure)
        assert run_tick(poller, source, store, sink, owner_id="a", refusals=refusals).stop_reason == "sink_refusing"
        assert otel.total("dbfanout.sends_refused", poller=poller_name, reason="throttled") == 1
        assert gauge() == 1
        assert otel.total("dbfanout.failures", poller=poller_name) == 0
        # When the broker accepts again; Then the gauge is 0
        servicebus.faults.unthrottle()
        wait_until(lambda: refusals.wait_seconds() == 0, 5, "the backoff window to pass")
        assert run_tick(poller, source, store, sink, owner_id="a", refusals=refusals).rows == 5
        assert gauge() == 0
    finally:
        servicebus.faults.unthrottle()
        sink.close()
        fast.close()


def test_a_process_that_lost_the_lease_forgets_its_refusal_and_its_gauge() -> None:
    refusals = SinkRefusals("p-forget", monotonic=Monotonic())
    refusals.refused(_refusal())
    assert metrics.sink_refusing.get({"poller": "p-forget"}) == 1
    # When another instance holds the lease (the tick's lease_held outcome)
    refusals.forget()
    # Then this process no longer reports a refusal it cannot see end
    assert not refusals.refusing and refusals.wait_seconds() == 0
    assert metrics.sink_refusing.get({"poller": "p-forget"}) == 0
