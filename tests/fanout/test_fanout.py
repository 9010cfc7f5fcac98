"""Fan-out through the real protocols: poller → queue → worker (issues 4 and 9).

Service Bus runs on the project's emulator, Storage Queues on Azurite. Each test asserts on
what the handler's target table holds, and on the queue and its dead-letter / poison queue.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from azure.servicebus import ServiceBusClient
from azure.storage.blob import BlobServiceClient

from sbemulator import Emulator
from shared.claimcheck import ClaimCheck
from shared.codec import decode_batch
from shared.errors import OversizeRowError
from tests.fanout.pipeline import Pipeline
from tests.fanout.transports import ServiceBusTransport, StorageQueueTransport, Transport
from tests.support.azurite import Azurite
from tests.support.ports import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(servicebus: Emulator) -> Iterator[ServiceBusClient]:
    with ServiceBusClient.from_connection_string(servicebus.connection_string, retry_total=0) as c:
        yield c


@pytest.fixture(params=["servicebus", "storage-queue"])
def transport(request: pytest.FixtureRequest, azurite: Azurite) -> Transport:
    if request.param == "servicebus":
        return ServiceBusTransport(request.getfixturevalue("servicebus"), request.getfixturevalue("client"))
    return StorageQueueTransport(azurite.connection_string)


def test_w1_reenqueue_after_failed_commit_is_dropped_by_duplicate_detection(
    servicebus: Emulator, client: ServiceBusClient, tmp_path: Path
) -> None:
    bus = ServiceBusTransport(servicebus, client)
    pipe = Pipeline.build(bus, tmp_path)
    pipe.source_table.upsert(range(250))
    # Given the first commit fails after its batch was enqueued (W1)
    pipe.store.fail_next_commit("error")
    with pytest.raises(Exception, match="commit"):
        pipe.tick()
    # When the next tick re-sends that batch with the same message id, then the rest
    assert pipe.tick().rows == 250
    # Then the queue holds each message once: 3 pages of 100, 100, 50
    assert bus.active() == 3
    pipe.consume_until(pipe.worker(), lambda: pipe.target.rows() == pipe.source_table.states())
    handled = pipe.target.handled_event_ids()
    assert len(handled) == len(set(handled)) == 250
    assert pipe.target.calls == 3


def test_w1_duplicate_copies_are_absorbed_by_the_processed_events_helper(
    transport: Transport, servicebus: Emulator, client: ServiceBusClient, tmp_path: Path
) -> None:
    if isinstance(transport, ServiceBusTransport):  # the broker keeps duplicates when detection is off
        transport = ServiceBusTransport(servicebus, client, requires_duplicate_detection=False)
    pipe = Pipeline.build(transport, tmp_path)
    pipe.source_table.upsert(range(250))
    pipe.store.fail_next_commit("error")
    with pytest.raises(Exception, match="commit"):
        pipe.tick()
    pipe.tick()
    # Given the queue holds a re-sent copy of every page the failed write was to cover: with
    # pipelined commits (the default) that is all 3 pages of the tick (100, 100, 50)
    assert pipe.poller.max_uncommitted_batches >= 3
    assert transport.pending() == 3 + 3
    pipe.consume_until(pipe.worker(), lambda: transport.pending() == 0)
    # Then the handler saw them, and the target still holds every row exactly once
    assert pipe.target.calls == 6
    assert pipe.target.rows() == pipe.source_table.states()
    handled = pipe.target.handled_event_ids()
    assert len(handled) == len(set(handled)) == 250


def test_one_poison_row_in_100_reaches_the_dead_letters_alone(transport: Transport, tmp_path: Path) -> None:
    pipe = Pipeline.build(transport, tmp_path)
    pipe.source_table.upsert(range(100))
    pipe.source_table.upsert([42], "poison")
    assert pipe.tick().rows == 100
    assert transport.pending() == 1  # one 100-event message
    # When workers process it: fail, fail + split, 99 singles succeed, the poison single is retried to the DLQ
    pipe.consume_until(pipe.worker(), lambda: len(transport.dead()) == 1 and transport.pending() == 0)
    assert pipe.target.rows() == pipe.source_table.states() - {(42, 101)}
    handled = pipe.target.handled_event_ids()
    assert len(handled) == len(set(handled)) == 99  # each good row handled exactly once
    ((body, reason),) = transport.dead()
    assert [e.pk["id"] for e in decode_batch(body).events] == [42]
    if isinstance(transport, StorageQueueTransport):  # a quarantine never expires
        (poisoned,) = transport.poison.peek_messages(max_messages=1)
        assert poisoned.expires_on is None or poisoned.expires_on.year >= 9999
    assert reason in ("MaxDeliveryCountExceeded", "MaxDequeueCountExceeded")


def test_malformed_and_foreign_messages_end_in_the_dead_letters_and_the_rest_is_served(
    transport: Transport, tmp_path: Path
) -> None:
    pipe = Pipeline.build(transport, tmp_path)
    pipe.source_table.upsert(range(5))
    transport.send_raw(b"\x00not json", "garbage")
    transport.send_raw(b'{"schema": "someone-else/2", "x": 1}', "foreign")
    if isinstance(transport, StorageQueueTransport):
        transport.send_raw(b"", "not-base64")
    pipe.tick()
    expected = 3 if isinstance(transport, StorageQueueTransport) else 2
    pipe.consume_until(pipe.worker(), lambda: len(transport.dead()) == expected and transport.pending() == 0)
    assert pipe.target.rows() == pipe.source_table.states()
    bodies = sorted(body for body, _ in transport.dead())
    assert b'{"schema": "someone-else/2", "x": 1}' in bodies and b"\x00not json" in bodies


def test_oversize_row_fails_clearly_and_keeps_the_checkpoint(transport: Transport, tmp_path: Path) -> None:
    pipe = Pipeline.build(transport, tmp_path)
    pipe.source_table.upsert(range(3))
    pipe.source_table.upsert([1], "x" * 300_000)
    with pytest.raises(OversizeRowError, match=r"poller orders: row \{'id': 1\}"):
        pipe.tick()
    snap = pipe.store.load()
    assert snap is not None and snap.doc.checkpoint.position is None
    assert transport.pending() == 0


def test_claim_check_delivers_an_oversize_row_intact(transport: Transport, tmp_path: Path, azurite: Azurite) -> None:
    container = BlobServiceClient.from_connection_string(azurite.connection_string).create_container(
        f"claims-{uuid.uuid4().hex[:10]}"
    )
    claims = ClaimCheck(container)
    pipe = Pipeline.build(transport, tmp_path)
    pipe.poller = replace(pipe.poller, oversize_policy="claim-check")
    big = "y" * 300_000
    pipe.source_table.upsert(range(3))
    pipe.source_table.upsert([1], big)
    assert pipe.tick(pipe.sink(claim_check=claims.offload)).rows == 3
    pipe.consume_until(pipe.worker(resolve_claims=claims.resolve), lambda: len(pipe.target.rows()) == 3)
    with pipe.target.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT v FROM target WHERE id = 1").scalar_one() == big


def test_a_lingering_tick_puts_a_row_written_mid_linger_on_the_queue_before_it_ends(
    transport: Transport, tmp_path: Path
) -> None:
    # Given a lingering poller (4 s, polling every 50 ms) on this transport, caught up with rows 0-4
    pipe = Pipeline.build(transport, tmp_path)
    pipe.poller = replace(pipe.poller, linger_seconds=4.0, poll_interval_ms=50)
    pipe.source_table.upsert(range(5))
    result: list[object] = []
    tick = threading.Thread(target=lambda: result.append(pipe.tick()), daemon=True)
    tick.start()
    wait_until(lambda: transport.pending() >= 1, 10, "the first batch on the queue")
    # When a row is written while the tick lingers
    pipe.source_table.upsert([5])
    # Then its batch is on the queue while the same tick still runs
    wait_until(lambda: transport.pending() >= 2, 3, "the row written mid-linger on the queue")
    assert tick.is_alive()
    tick.join(10)
    assert not tick.is_alive() and getattr(result[0], "rows", None) == 6
    # And the worker delivers every row to the handler
    pipe.consume_until(pipe.worker(), lambda: pipe.target.rows() == pipe.source_table.states())
