"""``dbfanout run`` with ``oversize_policy = "claim-check"``: a 1 MB row arrives whole, on both
transports; a message whose claim blob is gone is dead-lettered with a clear error, its healthy
rows handled."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from azure.servicebus import ServiceBusClient, ServiceBusSubQueue
from azure.storage.blob import BlobServiceClient
from azure.storage.queue import QueueServiceClient

from poller.sinks.servicebus import ServiceBusSink
from sbemulator import Emulator
from sbemulator.testing import unique_queue
from shared.claimcheck import open_claim_check
from shared.codec import decode_batch
from shared.config import load_config
from shared.ids import event_id_for
from shared.models import Batch, RowChange
from shared.servicebus import QueueSender
from shared.settings import load_settings
from shared.storagequeue import poison_queue_name
from tests.host.app_support import SOURCE_DDL, AppDir, HostProcess, Target, sqlite_engine, wait_for
from tests.support.azurite import Azurite

pytestmark = pytest.mark.integration

BIG = "x" * 1_000_000  # a 1 MB row: four times Service Bus Standard's 256 KB, twenty Storage Queues' 48 KB


def _app(tmp_path: Path, azurite: Azurite, servicebus: Emulator, transport: str) -> AppDir:
    if transport == "servicebus":
        queue = unique_queue(servicebus, "claims", requires_duplicate_detection=True, max_delivery_count=3)
    else:
        service = QueueServiceClient.from_connection_string(azurite.connection_string)
        queue = f"claims-{uuid.uuid4().hex[:10]}"
        service.create_queue(queue)
        service.create_queue(poison_queue_name(queue))
    return AppDir.create(
        tmp_path / "app",
        queue=queue,
        storage=azurite.connection_string,
        servicebus=servicebus.connection_string,
        transport=transport,
        queues_json={"maxPollingInterval": "00:00:00.500", "maxDequeueCount": 3},
        poller_toml='oversize_policy = "claim-check"\nmax_delivery_count = 3',
    )


def _source(app: AppDir) -> sa.Engine:
    engine = sqlite_engine(app.root / "source.db")
    with engine.begin() as conn:
        conn.exec_driver_sql(SOURCE_DDL)
    return engine


@pytest.mark.parametrize("transport", ["servicebus", "storage-queue"])
def test_a_1mb_row_reaches_the_handler_whole(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, transport: str
) -> None:
    # Given a claim-check poller and a source holding a 1 MB row between two small ones
    app = _app(tmp_path, azurite, servicebus, transport)
    source = _source(app)
    with source.begin() as conn:
        for i, v in ((1, "small"), (2, BIG), (3, "small")):
            conn.execute(sa.text("INSERT INTO orders (id, version, v) VALUES (:i, :i, :v)"), {"i": i, "v": v})
    target = Target(app.root / "target.db")
    host = HostProcess(app).start()
    try:
        # When the app runs
        wait_for(lambda: len(target.rows()) == 3, 90, "the three rows to reach the target")
        # Then the handler got the big row whole, and its claim sits in the state container
        assert target.rows()[2]["v"] == BIG
        container = BlobServiceClient.from_connection_string(azurite.connection_string).get_container_client("db-state")
        claims = [b.name for b in container.list_blobs(name_starts_with=f"claims/{app.app_name}/orders/")]
        assert len(claims) == 1, claims
        assert host.terminate() == 0, host.log_tail()
        if transport == "servicebus":
            assert servicebus.queue_stats(app.queue)["dead_lettered"] == 0
    finally:
        host.stop_quietly()
        target.close()


def test_a_missing_claim_is_dead_lettered_with_a_clear_error_and_its_neighbours_are_handled(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator
) -> None:
    # Given a message holding a small row and a claim-check reference whose blob was deleted
    app = _app(tmp_path, azurite, servicebus, "servicebus")
    _source(app).dispose()  # empty: the poller sends nothing of its own
    config = load_config(app_root=app.root, settings=load_settings(app.root))
    poller = config.poller("orders")
    claims = open_claim_check(config)
    events = tuple(
        RowChange(event_id_for("orders", "sha256:t", {"id": i}, i), "upsert", {"id": i}, i, {"id": i, "v": v}, "orders")
        for i, v in ((10, "small"), (11, BIG))
    )
    state = BlobServiceClient.from_connection_string(azurite.connection_string).get_container_client("db-state")
    if not state.exists():
        state.create_container()
    with ServiceBusClient.from_connection_string(servicebus.connection_string) as client:
        sink = ServiceBusSink(poller, QueueSender(client, app.queue), claim_check=claims.offload)
        sink.send(Batch("orders", "batch-missing", "sha256:t", events))
    state.delete_blob(claims.blob_name(events[1]))
    target = Target(app.root / "target.db")
    host = HostProcess(app).start()
    try:
        # When the app runs
        def settled() -> bool:
            stats = servicebus.queue_stats(app.queue)
            return bool(stats["dead_lettered"] == 1 and stats["messages"] == 0)

        wait_for(settled, 90, "the DLQ to hold one message")
        # Then the small row was handled, and the DLQ holds exactly the single with the missing claim
        wait_for(lambda: 10 in target.rows(), 30, "the small row")
        assert set(target.rows()) == {10}
        with (
            ServiceBusClient.from_connection_string(servicebus.connection_string) as client,
            client.get_queue_receiver(app.queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq,
        ):
            (dead,) = dlq.peek_messages(max_message_count=5)
        assert [e.event_id for e in decode_batch(b"".join(dead.body)).events] == [events[1].event_id]
        # And the log says which blob is missing and what to do
        log = host.log_text()
        assert f"claim-check blob db-state/{claims.blob_name(events[1])}" in log and "is missing" in log, log[-3000:]
        assert host.terminate() == 0, host.log_tail()
    finally:
        host.stop_quietly()
        target.close()
