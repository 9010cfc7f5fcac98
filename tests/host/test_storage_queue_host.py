"""The local host's Storage Queue trigger on Azurite: message shape, retries, the poison queue, end to end.

The runner is driven in-process with a small function for the queue-trigger semantics, and the
real ``function_app.py`` runs in a ``dbfanout run`` subprocess for the end-to-end check.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import azure.functions as func
import pytest
from azure.storage.queue import QueueClient, QueueServiceClient

from dbfanout.host.app_loader import FunctionSpec
from dbfanout.host.hostjson import QueueOptions, load_host_json
from dbfanout.host.storagequeue import StorageQueueRunner, queue_connection
from shared.errors import ConfigError
from shared.storagequeue import decode_queue_text, encode_queue_text, poison_queue_name
from tests.host.app_support import REPO, AppDir, HostProcess, SourceWriter, Target, wait_for
from tests.support.azurite import Azurite

pytestmark = pytest.mark.integration

CONNECTION = "TEST_QUEUES"
FAST = QueueOptions(batch_size=4, new_batch_threshold=2, max_polling_interval_seconds=0.5, max_dequeue_count=3)


@pytest.fixture
def queues(azurite: Azurite) -> Iterator[tuple[QueueClient, QueueClient]]:
    """A fresh queue and its poison queue."""
    service = QueueServiceClient.from_connection_string(azurite.connection_string)
    name = f"q-{uuid.uuid4().hex[:12]}"
    main, poison = service.create_queue(name), service.create_queue(poison_queue_name(name))
    yield main, poison
    main.delete_queue()
    poison.delete_queue()


def _runner(
    azurite: Azurite, queue: str, call: Callable[[func.QueueMessage], None], options: QueueOptions = FAST
) -> StorageQueueRunner:
    trigger = {"type": "queueTrigger", "name": "msg", "queueName": queue, "connection": CONNECTION}
    spec = FunctionSpec(f"work_{queue}", trigger, call)
    return StorageQueueRunner(spec, {CONNECTION: azurite.connection_string}, options)


def _count(client: QueueClient) -> int:
    return len(client.peek_messages(max_messages=32))


def test_a_function_gets_functions_shaped_messages_and_a_failure_is_retried(
    azurite: Azurite, queues: tuple[QueueClient, QueueClient]
) -> None:
    # Given a function that fails on its first call and records what it receives
    main, poison = queues
    seen: list[func.QueueMessage] = []

    def work(msg: func.QueueMessage) -> None:
        seen.append(msg)
        if len(seen) == 1:
            raise RuntimeError("first attempt fails")

    main.send_message(encode_queue_text(b'{"hello": "queue"}'))
    runner = _runner(azurite, main.queue_name, work)
    # When the runner serves the queue until the message is gone
    runner.start()
    try:
        wait_for(lambda: runner.deleted == 1, 30, "the message to be handled")
    finally:
        runner.stop(5)
        assert runner.join(10)
    # Then the function saw the decoded body twice, with dequeue counts 1 and 2, like on Azure
    assert [m.dequeue_count for m in seen] == [1, 2]
    assert all(m.get_body() == b'{"hello": "queue"}' for m in seen)
    first = seen[0]
    assert first.id and first.id == seen[1].id
    assert first.pop_receipt and first.insertion_time and first.expiration_time and first.time_next_visible
    assert first.insertion_time < first.expiration_time
    # And the queue and its poison queue are empty
    assert _count(main) == 0 and _count(poison) == 0
    assert runner.running == 0


def test_a_message_failing_max_dequeue_count_times_moves_to_the_poison_queue(
    azurite: Azurite, queues: tuple[QueueClient, QueueClient]
) -> None:
    # Given a function that always fails, maxDequeueCount 3, and three kinds of messages:
    # a normal one, one already dequeued beyond the limit, and one that is not base64 text
    main, poison = queues
    calls: dict[bytes, int] = {}
    lock = threading.Lock()

    def work(msg: func.QueueMessage) -> None:
        with lock:
            calls[msg.get_body()] = calls.get(msg.get_body(), 0) + 1
        raise RuntimeError("handler bug")

    worn = main.send_message(encode_queue_text(b"worn"))
    for _ in range(4):  # dequeue it four times without deleting: its count will be 5 > 3 next time
        got = next(iter(main.receive_messages(visibility_timeout=30)))
        assert got.id == worn.id
        main.update_message(got, visibility_timeout=0)
    main.send_message(encode_queue_text(b"poison me"))
    main.send_message("%% not base64 %%")
    runner = _runner(azurite, main.queue_name, work)
    # When the runner serves the queue
    runner.start()
    try:
        wait_for(lambda: _count(poison) == 3, 60, "three messages in the poison queue")
        wait_for(lambda: _count(main) == 0, 30, "the originals to be deleted")
    finally:
        runner.stop(5)
        assert runner.join(10)
    # Then the normal one was tried exactly maxDequeueCount times; the others were never called
    assert calls == {b"poison me": 3}
    # And the poison queue holds the original texts (base64 as the binding expects, the foreign one as it was)
    texts = sorted(str(m.content) for m in poison.peek_messages(max_messages=32))
    assert "%% not base64 %%" in texts
    assert sorted(decode_queue_text(t) for t in texts if not t.startswith("%")) == [b"poison me", b"worn"]


def test_a_long_call_keeps_its_message_hidden_and_gets_it_once(
    azurite: Azurite, queues: tuple[QueueClient, QueueClient]
) -> None:
    # Given a function that works longer than the message's 2 s lease
    main, _ = queues
    calls: list[int | None] = []

    def work(msg: func.QueueMessage) -> None:
        calls.append(msg.dequeue_count)
        time.sleep(5)  # the work itself: the runner must renew the visibility meanwhile

    main.send_message(encode_queue_text(b"slow"))
    trigger = {"type": "queueTrigger", "name": "msg", "queueName": main.queue_name, "connection": CONNECTION}
    spec = FunctionSpec("work_slow", trigger, work)
    runner = StorageQueueRunner(spec, {CONNECTION: azurite.connection_string}, FAST, lease_seconds=2)
    # When the runner serves the queue
    runner.start()
    try:
        wait_for(lambda: runner.deleted == 1, 30, "the slow message to be deleted")
    finally:
        runner.stop(5)
        assert runner.join(10)
    # Then it was called once (renewals kept the message hidden) and the delete used the renewed receipt
    assert calls == [1]
    assert _count(main) == 0


def test_host_json_queues_defaults_and_our_choices(tmp_path: Path) -> None:
    # Given no host.json, then the repository's host.json
    defaults = load_host_json(tmp_path).queues
    ours = load_host_json(REPO).queues
    # Then the official defaults apply when nothing is set, and ours are read as written
    assert defaults == QueueOptions(batch_size=16, new_batch_threshold=8, max_polling_interval_seconds=60.0)
    assert defaults.visibility_timeout_seconds == 0 and defaults.max_dequeue_count == 5
    assert ours.max_dequeue_count == 5 and ours.visibility_timeout_seconds == 10.0
    assert ours.new_batch_threshold == ours.batch_size // 2
    # And a messageEncoding the local host cannot serve is refused by name
    (tmp_path / "host.json").write_text('{"extensions": {"queues": {"messageEncoding": "none"}}}')
    with pytest.raises(ConfigError, match="messageEncoding"):
        load_host_json(tmp_path)


def test_connection_settings_resolve_like_the_host() -> None:
    # Given prefixed, plain and identity-based settings
    settings: dict[str, Any] = {
        "AzureWebJobsQ": "UseDevelopmentStorage=true",
        "Q": "ignored",
        "ID__queueServiceUri": "https://acct.queue.core.windows.net",
        "ID__clientId": "abc",
    }
    # Then AzureWebJobs<NAME> wins, and NAME__queueServiceUri is an identity connection
    assert queue_connection(settings, "Q").connection_string == "UseDevelopmentStorage=true"
    identity = queue_connection(settings, "ID")
    assert identity.queue_service_uri == "https://acct.queue.core.windows.net" and identity.client_id == "abc"
    with pytest.raises(ConfigError):
        queue_connection(settings, "MISSING")


def test_run_replicates_a_concurrent_writer_over_a_storage_queue(tmp_path: Path, azurite: Azurite) -> None:
    # Given an app folder with a storage-queue poller, its queue and poison queue, and a running host
    service = QueueServiceClient.from_connection_string(azurite.connection_string)
    queue = f"orders-{uuid.uuid4().hex[:10]}"
    service.create_queue(queue)
    poison = service.create_queue(poison_queue_name(queue))
    app = AppDir.create(
        tmp_path / "app",
        queue=queue,
        storage=azurite.connection_string,
        servicebus="unused: this app has no Service Bus poller",
        transport="storage-queue",
        batch_size=50,
        queues_json={"maxPollingInterval": "00:00:00.500"},
    )
    writer = SourceWriter(app.root / "source.db", 400, pause=0.02)
    target = Target(app.root / "target.db")
    host = HostProcess(app).start()
    try:
        # When a writer inserts, updates and soft-deletes a few hundred rows while the app runs
        writer.start()
        writer.join(120)

        def converged() -> bool:
            return target.rows() == writer.expected()

        wait_for(converged, 90, "the target to match the source")
        # Then the target equals the live source rows, and nothing was poisoned
        assert writer.ops["update"] > 0 and writer.ops["delete"] > 0
        assert target.processed() >= len(writer.expected())
        assert _count(poison) == 0
        # And SIGTERM stops the host cleanly
        assert host.terminate() == 0, host.log_tail()
        assert "host started" in host.log_text() and "host stopped" in host.log_tail()
    finally:
        host.stop_quietly()
        target.close()
