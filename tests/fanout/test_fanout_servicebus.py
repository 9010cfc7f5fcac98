"""Fan-out through the real protocol: poller → emulator queue → worker (issue 4).

Each test asserts on what the handler's target table holds, and on the queue and its DLQ.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusSubQueue
from azure.storage.blob import BlobServiceClient

from sbemulator import Emulator
from shared.claimcheck import ClaimCheck
from shared.codec import decode_batch
from shared.errors import OversizeRowError
from tests.fanout.pipeline import Pipeline
from tests.support.azurite import Azurite

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(servicebus: Emulator) -> Iterator[ServiceBusClient]:
    with ServiceBusClient.from_connection_string(servicebus.connection_string, retry_total=0) as c:
        yield c


def test_w1_reenqueue_after_failed_commit_is_dropped_by_duplicate_detection(
    servicebus: Emulator, client: ServiceBusClient, tmp_path: Path
) -> None:
    pipe = Pipeline.build(servicebus, client, tmp_path)
    pipe.source_table.upsert(range(250))
    # Given the first commit fails after its batch was enqueued (W1)
    pipe.store.fail_next_commit("error")
    with pytest.raises(Exception, match="commit"):
        pipe.tick()
    # When the next tick re-sends that batch with the same message id, then the rest
    assert pipe.tick().rows == 250
    # Then the queue holds each message once: 3 pages of 100, 100, 50
    assert pipe.stats()["active"] == 3
    pipe.consume_until(pipe.worker(), lambda: pipe.target.rows() == pipe.source_table.states())
    handled = pipe.target.handled_event_ids()
    assert len(handled) == len(set(handled)) == 250
    assert pipe.target.calls == 3


def test_w1_without_duplicate_detection_the_processed_events_helper_absorbs_the_copy(
    servicebus: Emulator, client: ServiceBusClient, tmp_path: Path
) -> None:
    pipe = Pipeline.build(servicebus, client, tmp_path, requires_duplicate_detection=False)
    pipe.source_table.upsert(range(250))
    pipe.store.fail_next_commit("error")
    with pytest.raises(Exception, match="commit"):
        pipe.tick()
    pipe.tick()
    # Given the broker kept the duplicate message
    assert pipe.stats()["active"] == 4
    pipe.consume_until(pipe.worker(), lambda: pipe.stats()["messages"] == 0)
    # Then the handler saw it, and the target still holds every row exactly once
    assert pipe.target.calls == 4
    assert pipe.target.rows() == pipe.source_table.states()
    handled = pipe.target.handled_event_ids()
    assert len(handled) == len(set(handled)) == 250


def test_one_poison_row_in_100_reaches_the_dlq_alone(
    servicebus: Emulator, client: ServiceBusClient, tmp_path: Path
) -> None:
    pipe = Pipeline.build(servicebus, client, tmp_path, max_delivery_count=3)
    pipe.source_table.upsert(range(100))
    pipe.source_table.upsert([42], "poison")
    assert pipe.tick().rows == 100
    assert pipe.stats()["active"] == 1  # one 100-event message
    # When workers process it: fail, fail + split, 99 singles succeed, the poison single is retried to the DLQ
    pipe.consume_until(pipe.worker(), lambda: pipe.stats()["dead_lettered"] == 1 and pipe.stats()["messages"] == 0)
    good = pipe.source_table.states() - {(42, 101)}
    assert pipe.target.rows() == good
    handled = pipe.target.handled_event_ids()
    assert len(handled) == len(set(handled)) == 99  # each good row handled exactly once
    with client.get_queue_receiver(pipe.poller.queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq:
        (dead,) = dlq.receive_messages(max_message_count=5, max_wait_time=2)
        batch = decode_batch(b"".join(dead.body))
        assert [e.pk["id"] for e in batch.events] == [42]
        assert dead.dead_letter_reason == "MaxDeliveryCountExceeded"
        dlq.complete_message(dead)


def test_malformed_and_foreign_messages_end_in_the_dlq_and_the_rest_is_served(
    servicebus: Emulator, client: ServiceBusClient, tmp_path: Path
) -> None:
    pipe = Pipeline.build(servicebus, client, tmp_path, max_delivery_count=2)
    pipe.source_table.upsert(range(5))
    with client.get_queue_sender(pipe.poller.queue) as sender:
        sender.send_messages(ServiceBusMessage(b"\x00not json", message_id="garbage"))
        sender.send_messages(ServiceBusMessage(b'{"schema": "someone-else/2", "x": 1}', message_id="foreign"))
    pipe.tick()
    pipe.consume_until(pipe.worker(), lambda: pipe.stats()["dead_lettered"] == 2 and pipe.stats()["messages"] == 0)
    assert pipe.target.rows() == pipe.source_table.states()
    with client.get_queue_receiver(pipe.poller.queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq:
        dead = dlq.receive_messages(max_message_count=5, max_wait_time=2)
        assert sorted(str(m.message_id) for m in dead) == ["foreign", "garbage"]
        assert {m.dead_letter_reason for m in dead} == {"MaxDeliveryCountExceeded"}


def test_oversize_row_fails_clearly_and_keeps_the_checkpoint(
    servicebus: Emulator, client: ServiceBusClient, tmp_path: Path
) -> None:
    pipe = Pipeline.build(servicebus, client, tmp_path)
    pipe.source_table.upsert(range(3))
    pipe.source_table.upsert([1], "x" * 300_000)
    with pytest.raises(OversizeRowError, match=r"poller orders: row \{'id': 1\}"):
        pipe.tick()
    assert pipe.store.load() is not None and pipe.store.load().doc.checkpoint.position is None  # type: ignore[union-attr]
    assert pipe.stats()["messages"] == 0


def test_claim_check_delivers_an_oversize_row_intact(
    servicebus: Emulator, client: ServiceBusClient, tmp_path: Path, azurite: Azurite
) -> None:
    from dataclasses import replace

    container = BlobServiceClient.from_connection_string(azurite.connection_string).create_container(
        f"claims-{uuid.uuid4().hex[:10]}"
    )
    claims = ClaimCheck(container)
    pipe = Pipeline.build(servicebus, client, tmp_path)
    pipe.poller = replace(pipe.poller, oversize_policy="claim-check")
    big = "y" * 300_000
    pipe.source_table.upsert(range(3))
    pipe.source_table.upsert([1], big)
    assert pipe.tick(pipe.sink(claim_check=claims.offload)).rows == 3
    pipe.consume_until(pipe.worker(resolve_claims=claims.resolve), lambda: len(pipe.target.rows()) == 3)
    with pipe.target.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT v FROM target WHERE id = 1").scalar_one() == big
