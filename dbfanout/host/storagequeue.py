"""Storage Queue triggers: poll a queue and run the function like the Functions queue trigger.

The Functions host (Storage Queues extension 5.x) fetches ``batchSize`` messages, hides each for a
while it renews, calls the function, then settles: return deletes the message; an exception makes
it visible again after ``visibilityTimeout``; the ``maxDequeueCount``-th failure moves it to
``<queue>-poison`` (copy first, original deleted after). A new batch is fetched when the calls in
flight drop to ``newBatchThreshold``; an empty queue is polled with an exponential backoff up to
``maxPollingInterval``.

Settlement is :func:`worker.settlement.settle_queue`, the same code the worker's consumers and the
fan-out tests use, so the local host and those tests cannot drift apart.
"""

from __future__ import annotations

import datetime as dt
import queue
import threading
import time
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field

from azure.core.exceptions import AzureError, ResourceExistsError
from azure.functions.queue import QueueMessage as FunctionsQueueMessage
from azure.storage.queue import QueueClient, QueueMessage

from dbfanout.host.app_loader import FunctionSpec
from dbfanout.host.hostjson import QueueOptions
from dbfanout.host.invoke import invoke
from dbfanout.host.runner import TriggerRunner
from dbfanout.host.schedule import resolve_setting
from shared.logs import get_logger, ids
from shared.settings import Settings, StorageConnection, storage_connection
from shared.storagequeue import decode_queue_text, poison_queue_name, queue_service_client
from worker.settlement import settle_queue

__all__ = ["DequeueCountExceeded", "StorageQueueRunner", "queue_connection", "to_functions_queue_message"]

log = get_logger("host.queues")

#: How long a received message stays hidden while its call runs; renewed at half of it. The
#: Functions host uses 10 minutes; a shorter one brings a killed local host's messages back sooner.
LEASE_SECONDS = 60
MIN_POLL_SECONDS = 0.1
DEFAULT_CONNECTION = "AzureWebJobsStorage"


class DequeueCountExceeded(Exception):
    """Received with a dequeue count above ``maxDequeueCount``: poisoned without calling the function."""


def queue_connection(settings: Settings, name: str | None) -> StorageConnection:
    """The binding's ``connection``, resolved as the host does.

    ``AzureWebJobs<NAME>`` wins over ``NAME``; a value is a connection string (the SDK reads
    ``UseDevelopmentStorage=true`` as Azurite's default endpoints); otherwise identity settings
    ``NAME__queueServiceUri`` (or ``__serviceUri`` / ``__blobServiceUri`` through the shared helper).
    """
    name = name or DEFAULT_CONNECTION
    for candidate in (f"AzureWebJobs{name}", name):
        if settings.get(candidate):
            return StorageConnection(connection_string=settings[candidate])
    uri = settings.get(f"{name}__queueServiceUri")
    if uri:
        return StorageConnection(queue_service_uri=uri, client_id=settings.get(f"{name}__clientId"))
    return storage_connection(settings, name)  # raises a ConfigError naming the setting, or a blob-URI identity


def to_functions_queue_message(msg: QueueMessage) -> FunctionsQueueMessage:
    """What a ``queue_trigger`` function receives on Azure: the decoded body and the message's facts."""
    return FunctionsQueueMessage(
        id=str(msg.id),
        body=decode_queue_text(msg.content),
        dequeue_count=int(msg.dequeue_count or 1),
        expiration_time=msg.expires_on,
        insertion_time=msg.inserted_on,
        time_next_visible=msg.next_visible_on,
        pop_receipt=msg.pop_receipt,
    )


@dataclass(eq=False)
class _Invocation:
    """One received message while its call runs; ``lock`` keeps renewal and settlement apart."""

    message: QueueMessage
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: bool = False
    renew_failed: bool = False


class StorageQueueRunner(TriggerRunner[_Invocation]):
    """Feeds one queue-triggered function until stopped."""

    def __init__(
        self,
        spec: FunctionSpec,
        settings: Mapping[str, str],
        options: QueueOptions,
        *,
        lease_seconds: int = LEASE_SECONDS,
    ) -> None:
        queue = resolve_setting(str(spec.trigger.get("queueName", "")), settings, f"{spec.name}.queueName")
        super().__init__(spec, queue, options.max_concurrent_calls)
        self.connection_name = str(spec.trigger.get("connection") or DEFAULT_CONNECTION)
        # Built here (no I/O yet) so a connection without a queue endpoint fails the start, not a thread.
        self._service = queue_service_client(queue_connection(settings, self.connection_name))
        self.options = options
        self._lease = lease_seconds
        self.deleted = 0
        self.failed = 0

    # ---- the poll loop -----------------------------------------------------------------------
    def _run(self) -> None:
        service = self._service
        client = service.get_queue_client(self.queue)
        poison = service.get_queue_client(poison_queue_name(self.queue))
        try:
            self._ensure_poison(poison)
            backoff = MIN_POLL_SECONDS
            while not self._stop.is_set():
                self._reap()
                self._renew_due(client)
                if len(self._inflight) > self.options.new_batch_threshold:
                    self._wait_for_a_call(MIN_POLL_SECONDS)
                    continue
                try:
                    got = self._fetch(client, poison)
                except AzureError as exc:
                    # Queue missing, storage unreachable: keep polling at the slowest pace until it returns.
                    log.warning("receive failed; retrying", extra=ids(queue=self.queue, error=repr(exc)))
                    got, backoff = 0, self.options.max_polling_interval_seconds
                if got:
                    backoff = MIN_POLL_SECONDS
                    continue
                # An empty queue: back off exponentially, but wake early when a call finishes.
                self._wait_for_a_call(backoff)
                backoff = min(backoff * 2, self.options.max_polling_interval_seconds)
            self._drain(client)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            client.close()
            poison.close()
            service.close()

    def _ensure_poison(self, poison: QueueClient) -> None:
        """The host creates the poison queue when it first needs it; creating it up front is equivalent."""
        try:
            poison.create_queue()
        except ResourceExistsError:
            pass
        except AzureError as exc:
            log.warning("could not create the poison queue", extra=ids(queue=poison.queue_name, error=repr(exc)))

    def _fetch(self, client: QueueClient, poison: QueueClient) -> int:
        count = min(self.options.batch_size, 32)
        pages = client.receive_messages(messages_per_page=count, max_messages=count, visibility_timeout=self._lease)
        received = list(pages)
        for message in received:
            invocation = _Invocation(message)
            self._inflight.add(invocation)
            self._pool.submit(self._call, client, poison, invocation)
        return len(received)

    def _wait_for_a_call(self, timeout: float) -> None:
        with suppress(queue.Empty):
            self._done.put(self._done.get(timeout=timeout))  # peek: _reap takes it off

    def _reap(self) -> None:
        while True:
            try:
                self._inflight.discard(self._done.get_nowait())
            except queue.Empty:
                return

    def _drain(self, client: QueueClient) -> None:
        """Graceful stop: let in-flight calls finish (bounded), renewing their visibility meanwhile."""
        deadline = time.monotonic() + self._grace
        while self._inflight and time.monotonic() < deadline:
            self._renew_due(client)
            self._wait_for_a_call(MIN_POLL_SECONDS)
            self._reap()
        if self._inflight:
            # Not lost: they become visible again when their lease runs out, and are redelivered.
            log.warning("stopped with calls still running", extra=ids(queue=self.queue, running=len(self._inflight)))

    # ---- one call ----------------------------------------------------------------------------
    def _call(self, client: QueueClient, poison: QueueClient, invocation: _Invocation) -> None:
        message = invocation.message
        try:
            error = self._invoke(invocation)
            ok = settle_queue(
                client,
                poison,
                message,
                error,
                # undecodable: poison at once, as the host
                max_dequeue_count=self.options.max_dequeue_count if _decodable(message) else 1,
                visibility_timeout=int(self.options.visibility_timeout_seconds),
            )
            if ok:
                self.deleted += 1
            else:
                self.failed += 1
        except Exception as exc:  # the poison send failed: the message comes back after its lease
            log.warning("settlement failed", extra=ids(queue=self.queue, message_id=message.id, error=repr(exc)))
        finally:
            with invocation.lock:
                invocation.finished = True
            self._done.put(invocation)

    def _invoke(self, invocation: _Invocation) -> Exception | None:
        """Call the function; its exception (if any) is the outcome settlement acts on."""
        message = invocation.message
        max_count = self.options.max_dequeue_count
        try:
            if int(message.dequeue_count or 1) > max_count:
                raise DequeueCountExceeded(f"dequeue count {message.dequeue_count} > maxDequeueCount {max_count}")
            invoke(self.spec, to_functions_queue_message(message))
        except Exception as exc:  # any failure: retry, then the poison queue
            return exc
        finally:
            with invocation.lock:  # no renewal after this: settlement reads a stable pop receipt
                invocation.finished = True
        return None

    def _renew_due(self, client: QueueClient) -> None:
        """Keep running calls' messages hidden: update visibility once half the lease has passed."""
        now = dt.datetime.now(dt.UTC)
        for invocation in list(self._inflight):
            message = invocation.message
            visible_at = message.next_visible_on
            if invocation.renew_failed or visible_at is None:
                continue
            if (visible_at - now).total_seconds() > self._lease / 2:
                continue
            with invocation.lock:
                if invocation.finished:
                    continue
                try:
                    updated = client.update_message(message, visibility_timeout=self._lease)
                except AzureError as exc:
                    invocation.renew_failed = True  # it may be delivered again meanwhile; handlers dedupe
                    log.warning(
                        "visibility renewal failed", extra=ids(queue=self.queue, message_id=message.id, error=repr(exc))
                    )
                    continue
                message.pop_receipt = updated.pop_receipt
                message.next_visible_on = updated.next_visible_on


def _decodable(message: QueueMessage) -> bool:
    try:
        decode_queue_text(message.content)
    except (ValueError, TypeError):
        return False
    return True
