"""The Service Bus adapter both sides use: clients from settings, a reusable queue (or topic)
sender, and the one place SDK errors become dbfanout errors (STYLE R2).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusSender
from azure.servicebus.exceptions import (
    MessageSizeExceededError,
    MessagingEntityNotFoundError,
    OperationTimeoutError,
    ServiceBusCommunicationError,
    ServiceBusConnectionError,
    ServiceBusError,
    ServiceBusQuotaExceededError,
    ServiceBusServerBusyError,
)

from shared.errors import BrokerRefusingError, EnqueueError, OversizeRowError
from shared.logs import get_logger, ids
from shared.messages import OutgoingMessage
from shared.settings import ServiceBusConnection, Settings, servicebus_connection

__all__ = ["EntityKind", "LazyServiceBusClient", "QueueSender", "bus_errors", "servicebus_client", "to_sdk_message"]

log = get_logger("servicebus")

#: What a sender sends to: a queue, or a topic (every subscription gets a copy).
EntityKind = Literal["queue", "topic"]


def servicebus_client(conn: ServiceBusConnection, **kwargs: Any) -> ServiceBusClient:
    """A client from a connection string, or from a namespace and an Entra identity."""
    if conn.connection_string:
        return ServiceBusClient.from_connection_string(conn.connection_string, **kwargs)
    from azure.identity import DefaultAzureCredential

    assert conn.fully_qualified_namespace is not None
    credential = DefaultAzureCredential(managed_identity_client_id=conn.client_id)
    return ServiceBusClient(conn.fully_qualified_namespace, credential, **kwargs)


class LazyServiceBusClient:
    """One process-wide client of a connection setting, built on the first call and then reused.

    Building waits for the first send, so a missing setting fails that send (not the import).
    Thread-safe; ``close`` closes the client, and a later call builds a new one.
    """

    def __init__(self, settings: Settings, connection_name: str) -> None:
        self._settings = settings
        self._connection_name = connection_name
        self._client: ServiceBusClient | None = None
        self._lock = threading.Lock()

    def __call__(self) -> ServiceBusClient:
        with self._lock:
            if self._client is None:
                self._client = servicebus_client(servicebus_connection(self._settings, self._connection_name))
            return self._client

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


@contextmanager
def bus_errors(op: str, queue: str, *, kind: EntityKind = "queue") -> Iterator[None]:
    """Map SDK errors to EnqueueError (and OversizeRowError), ``from`` the original.

    A broker that refuses for now — the entity is full (QuotaExceeded), the namespace throttles
    (ServerBusy), or it cannot be reached — raises :class:`BrokerRefusingError`, which the poller
    treats as a state to back off from rather than a failure. ``kind`` names the entity in the
    messages (``"topic"`` for a topic poller's sends).
    """
    try:
        yield
    except MessageSizeExceededError as exc:
        raise OversizeRowError(f"{op} to {kind} {queue}: the broker rejected a message as too large") from exc
    except MessagingEntityNotFoundError as exc:
        raise EnqueueError(
            f"{op}: {kind} {queue} does not exist",
            hint=f"create the {kind} (infra/ does, one per poller) or fix the poller's {kind} key",
        ) from exc
    except ServiceBusQuotaExceededError as exc:
        raise BrokerRefusingError(f"{op} to {kind} {queue} refused: the {kind} is full: {exc}", "queue_full") from exc
    except ServiceBusServerBusyError as exc:
        raise BrokerRefusingError(f"{op} to {kind} {queue} refused: the broker is busy: {exc}", "throttled") from exc
    except (ServiceBusConnectionError, ServiceBusCommunicationError, OperationTimeoutError) as exc:
        message = f"{op} to {kind} {queue} failed: the broker is unreachable: {type(exc).__name__}: {exc}"
        raise BrokerRefusingError(message, "unreachable") from exc
    except ServiceBusError as exc:
        raise EnqueueError(f"{op} to {kind} {queue} failed: {type(exc).__name__}: {exc}") from exc
    except (OSError, TimeoutError) as exc:
        message = f"{op} to {kind} {queue} failed: the broker is unreachable: {type(exc).__name__}: {exc}"
        raise BrokerRefusingError(message, "unreachable") from exc


def to_sdk_message(message: OutgoingMessage) -> ServiceBusMessage:
    return ServiceBusMessage(
        message.body,
        message_id=message.message_id,
        content_type=message.content_type,
        subject=message.subject,
        session_id=message.session_id,
        application_properties=_props(message),
    )


def _props(message: OutgoingMessage) -> dict[str | bytes, Any]:
    return dict(message.application_properties.items())


class QueueSender:
    """One sender per queue (or topic: ``kind="topic"``), opened once and reused (opening costs
    about a second).

    ``send_all`` returns only when the broker accepted every message; after any failure the
    sender is closed so the next call opens a fresh link. A topic gets the very same messages as
    a queue would (ids, bodies, properties); each of its subscriptions receives a copy.
    """

    def __init__(
        self, client: ServiceBusClient, queue: str, *, kind: EntityKind = "queue", timeout: float = 30.0
    ) -> None:
        self._client = client
        self.queue = queue
        self.kind: EntityKind = kind
        self._timeout = timeout
        self._sender: ServiceBusSender | None = None
        self._lock = threading.Lock()

    def send_all(self, messages: Sequence[OutgoingMessage]) -> None:
        if not messages:
            return
        with self._lock:
            try:
                with bus_errors("send", self.queue, kind=self.kind):
                    self._send_batches(self._open(), messages)
            except EnqueueError:
                self._close_quietly()
                raise

    def _open(self) -> ServiceBusSender:
        if self._sender is None:
            if self.kind == "topic":
                self._sender = self._client.get_topic_sender(self.queue)
            else:
                self._sender = self._client.get_queue_sender(self.queue)
        return self._sender

    def _send_batches(self, sender: ServiceBusSender, messages: Sequence[OutgoingMessage]) -> None:
        """Send ``messages`` in order, in as few round trips as the link's size limit allows.

        Messages whose bodies may share a batch go as one SDK batch; a message that cannot share
        one with its neighbour (their bodies alone exceed the limit: pages packed near it, the
        usual catch-up) goes as a plain message: the SDK encodes a message once to size it for a
        batch and again inside the batch, and a failed add a third time, for the same round trip
        (about a fifth of the send's CPU; BENCHMARKS.md, wire path).
        """
        limit = sender.create_message_batch().max_size_in_bytes  # the link's (opens it on first use)
        group: list[OutgoingMessage] = []
        size = 0
        for message in messages:
            if group and size + len(message.body) > limit:
                self._send_group(sender, group)
                group, size = [], 0
            group.append(message)
            size += len(message.body)
        self._send_group(sender, group)
        log.debug("messages sent", extra=ids(**{self.kind: self.queue}, messages=len(messages)))

    def _send_group(self, sender: ServiceBusSender, group: Sequence[OutgoingMessage]) -> None:
        if len(group) == 1:  # a message too big for the link raises MessageSizeExceededError (OversizeRowError)
            sender.send_messages(to_sdk_message(group[0]), timeout=self._timeout)
            return
        batch = sender.create_message_batch()
        for message in group:
            sdk_message = to_sdk_message(message)
            try:
                batch.add_message(sdk_message)
                continue
            except ValueError:  # batch full: properties and framing did not fit after all
                pass
            if len(batch) == 0:
                raise OversizeRowError(
                    f"message {message.message_id} ({len(message.body)} bytes) exceeds the {self.kind}'s batch limit"
                )
            sender.send_messages(batch, timeout=self._timeout)
            batch = sender.create_message_batch()
            batch.add_message(sdk_message)
        if len(batch):
            sender.send_messages(batch, timeout=self._timeout)

    def _close_quietly(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            try:
                sender.close()
            except Exception:  # closing a broken link may fail too; the next send reopens
                log.debug("closing a failed sender raised", exc_info=True)

    def close(self) -> None:
        with self._lock:
            self._close_quietly()
