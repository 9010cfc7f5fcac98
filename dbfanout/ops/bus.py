"""Service Bus for operators: clients from the config, message views, bounded peeks, queue facts.

An operator names where messages wait as an :class:`Entity`: a queue, or one subscription of a
topic poller (``TOPIC/SUBSCRIPTION``, see :func:`resolve_entity`).

Application property keys and values come back from AMQP as bytes; :func:`props_of` turns them
into ``str`` so they print, compare and export as JSON.
"""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from azure.servicebus import (
    ServiceBusClient,
    ServiceBusReceivedMessage,
    ServiceBusReceiver,
    ServiceBusSender,
    ServiceBusSubQueue,
)
from azure.servicebus.exceptions import MessagingEntityNotFoundError, ServiceBusError

from shared.codec import loads
from shared.config import Config
from shared.errors import ConfigError, EnqueueError, SerializationError
from shared.messages import PROP_EVENT_COUNT, PROP_POLLER
from shared.servicebus import bus_errors, servicebus_client
from shared.settings import servicebus_connection
from shared.topology import parse_entity

__all__ = [
    "DLQ_DESCRIPTION",
    "DLQ_REASON",
    "SESSION_QUEUE_ACTIVE",
    "Entity",
    "MessageView",
    "QueueProbe",
    "as_entity",
    "bus_client",
    "entity_errors",
    "is_emulator",
    "peek_all",
    "peek_receiver",
    "probe_queue",
    "probe_topic",
    "props_of",
    "queue_exists",
    "refuses_non_session",
    "resolve_entity",
]

DLQ_REASON = "DeadLetterReason"
DLQ_DESCRIPTION = "DeadLetterErrorDescription"
PEEK_PAGE = 100
# What the service answers a non-session receiver of a session-enabled queue: "It is not possible for
# an entity that requires sessions to create a non-sessionful message receiver." (amqp:not-allowed)
_SESSION_REFUSALS = ("requires sessions", "non-sessionful")
SESSION_QUEUE_ACTIVE = "n/a: session queue (peeking it needs a session lock, which would take one from a worker)"


@dataclass(frozen=True, slots=True)
class Entity:
    """Where messages wait: a queue (``subscription`` None) or one subscription of a topic.

    ``name`` is the queue or the topic. Operators name it ``queue`` or ``topic/subscription``.
    """

    name: str
    subscription: str | None = None

    @property
    def is_subscription(self) -> bool:
        return self.subscription is not None

    @property
    def label(self) -> str:
        """``queue`` or ``topic/subscription``."""
        return f"{self.name}/{self.subscription}" if self.subscription is not None else self.name

    @property
    def dlq_label(self) -> str:
        """Its dead-letter queue, as operators read it: ``queue/$DeadLetterQueue``, ``topic/sub/$DeadLetterQueue``."""
        return f"{self.label}/$DeadLetterQueue"

    def receiver(self, client: ServiceBusClient, **kwargs: Any) -> ServiceBusReceiver:
        """A receiver of the queue or the subscription (``sub_queue=`` for the DLQ)."""
        if self.subscription is not None:
            return client.get_subscription_receiver(self.name, self.subscription, **kwargs)
        return client.get_queue_receiver(self.name, **kwargs)

    def sender(self, client: ServiceBusClient) -> ServiceBusSender:
        """Where copies go: the queue, or the topic (copies then carry ``dbfanout-to``: the subscription)."""
        if self.subscription is not None:
            return client.get_topic_sender(self.name)
        return client.get_queue_sender(self.name)


def as_entity(entity: str | Entity) -> Entity:
    """A queue name stays a queue (the ops functions take either)."""
    return entity if isinstance(entity, Entity) else Entity(entity)


def resolve_entity(config: Config, text: str) -> Entity:
    """What ``dbfanout dlq ... ENTITY`` names: a configured queue first (queue names may hold ``/``),
    then ``TOPIC/SUBSCRIPTION`` of a topic poller, else a queue as given (an unconfigured queue
    works as it always did).

    Raises :class:`ConfigError` for an unknown subscription of a configured topic (naming the
    configured ones), and for a bare topic name (a topic has no dead-letter queue of its own).
    """
    if text in config.queues():
        return Entity(text)
    topics = config.topics()
    topic, subscription = parse_entity(text)
    if subscription is not None and topic in topics:
        poller = topics[topic]
        poller.subscription(subscription)  # ConfigError naming the configured subscriptions
        return Entity(topic, subscription)
    if text in topics:
        names = ", ".join(f"{text}/{s}" for s in sorted(topics[text].subscriptions))
        raise ConfigError(
            f"pollers.{topics[text].name}.topic",
            f"{text} is a topic: each of its subscriptions has its own dead-letter queue",
            hint=f"name one: {names}",
        )
    return Entity(text)


@contextmanager
def entity_errors(op: str, entity: Entity) -> Iterator[None]:
    """:func:`shared.servicebus.bus_errors`, naming a missing subscription as a subscription."""
    try:
        with bus_errors(op, entity.label):
            yield
    except EnqueueError as exc:
        if entity.subscription is None or not isinstance(exc.__cause__, MessagingEntityNotFoundError):
            raise
        raise EnqueueError(
            f"{op}: subscription {entity.label} does not exist",
            hint="create it (infra/ does, one per configured subscription) or fix the poller's subscriptions",
        ) from exc.__cause__


def bus_client(config: Config) -> ServiceBusClient:
    """A client for the app's namespace (the ``servicebus_connection`` setting)."""
    return servicebus_client(servicebus_connection(config.settings, config.app.servicebus_connection))


def is_emulator(config: Config) -> bool:
    """True for a local emulator connection string (it has no management HTTP API)."""
    value = config.settings.get(config.app.servicebus_connection) or ""
    return "usedevelopmentemulator=true" in value.replace(" ", "").lower()


def _text(value: Any) -> Any:
    if isinstance(value, bytes | memoryview):
        raw = bytes(value)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return base64.b64encode(raw).decode()
    return value


def props_of(message: ServiceBusReceivedMessage) -> dict[str, Any]:
    """Application properties with ``str`` keys and decoded values."""
    return {str(_text(k)): _text(v) for k, v in (message.application_properties or {}).items()}


def _body(message: ServiceBusReceivedMessage) -> bytes:
    body = message.body
    if isinstance(body, bytes | bytearray):
        return bytes(body)
    return b"".join(bytes(part) for part in body)


@dataclass(frozen=True, slots=True)
class MessageView:
    """What an operator sees of one (dead-lettered) message; exported one per JSONL line."""

    sequence_number: int
    message_id: str
    enqueued_time: dt.datetime | None
    delivery_count: int
    reason: str | None
    description: str | None
    subject: str | None
    content_type: str | None
    correlation_id: str | None
    session_id: str | None
    application_properties: Mapping[str, Any]
    body: bytes = field(repr=False)
    #: The failure record of its last delivery (shared.failures), when the worker left one.
    failure: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, message: ServiceBusReceivedMessage) -> MessageView:
        props = props_of(message)
        return cls(
            sequence_number=int(message.sequence_number or 0),
            message_id=str(message.message_id),
            enqueued_time=message.enqueued_time_utc,
            delivery_count=int(message.delivery_count or 0),
            reason=message.dead_letter_reason or props.get(DLQ_REASON),
            description=message.dead_letter_error_description or props.get(DLQ_DESCRIPTION),
            subject=message.subject,
            content_type=message.content_type,
            correlation_id=message.correlation_id,
            session_id=message.session_id,
            application_properties=props,
            body=_body(message),
        )

    def envelope_summary(self) -> tuple[str | None, int | None, list[Any]]:
        """(poller, event count, first primary keys) from the body when it is a dbfanout envelope."""
        poller = self.application_properties.get(PROP_POLLER)
        count = self.application_properties.get(PROP_EVENT_COUNT)
        pks: list[Any] = []
        try:
            doc = loads(self.body)
        except SerializationError:
            return poller, count, pks
        if isinstance(doc, dict):
            poller = poller or doc.get("poller")
            raw = doc.get("events")
            events: list[Any] = raw if isinstance(raw, list) else []
            count = count if count is not None else len(events)
            pks = [e.get("pk") for e in events[:3] if isinstance(e, dict)]
        return poller, int(count) if count is not None else None, pks

    def to_json(self) -> dict[str, Any]:
        """One export line: every property, and the body as text (or base64 when not UTF-8)."""
        poller, count, pks = self.envelope_summary()
        doc: dict[str, Any] = {
            "sequence_number": self.sequence_number,
            "message_id": self.message_id,
            "enqueued_time": self.enqueued_time.isoformat() if self.enqueued_time else None,
            "delivery_count": self.delivery_count,
            "dead_letter_reason": self.reason,
            "dead_letter_error_description": self.description,
            "subject": self.subject,
            "content_type": self.content_type,
            "correlation_id": self.correlation_id,
            "session_id": self.session_id,
            "application_properties": dict(self.application_properties),
            "poller": poller,
            "event_count": count,
            "first_pks": pks,
            "failure": dict(self.failure) if self.failure is not None else None,
        }
        try:
            doc["body"] = self.body.decode()
        except UnicodeDecodeError:
            doc["body_base64"] = base64.b64encode(self.body).decode()
        return doc


def peek_all(
    client: ServiceBusClient, queue: str | Entity, *, dead_letter: bool = True, limit: int | None = None
) -> Iterator[MessageView]:
    """Peek (no locks, nothing changes) a queue or subscription in sequence order, at most ``limit`` messages."""
    entity = as_entity(queue)
    sub_queue = ServiceBusSubQueue.DEAD_LETTER if dead_letter else None
    with entity_errors("peek", entity), entity.receiver(client, sub_queue=sub_queue) as receiver:
        yield from peek_receiver(receiver, limit)


def peek_receiver(receiver: ServiceBusReceiver, limit: int | None = None) -> Iterator[MessageView]:
    """Peek through an open receiver (opening one costs a round trip or two: reuse it)."""
    seen, next_seq = 0, 1  # not 0: the SDK reads 0 as "continue after the last peek"
    with bus_errors("peek", receiver.entity_path):
        while limit is None or seen < limit:
            page = min(PEEK_PAGE, limit - seen) if limit is not None else PEEK_PAGE
            batch = receiver.peek_messages(max_message_count=page, sequence_number=next_seq)
            if not batch:
                return
            for message in batch:
                seen += 1
                yield MessageView.of(message)
            next_seq = int(batch[-1].sequence_number or 0) + 1


def refuses_non_session(exc: BaseException) -> bool:
    """True when ``exc`` (or what it was raised from) is the broker refusing a non-session receiver
    because the queue requires sessions: proof the queue exists and is session-enabled."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen).lower()
        if any(phrase in text for phrase in _SESSION_REFUSALS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@dataclass(frozen=True, slots=True)
class QueueProbe:
    """What a Listen-only look at a queue tells: whether it exists and whether it requires sessions.

    ``exists`` and ``requires_session`` are None when unknown; ``error`` then says why.
    """

    exists: bool | None
    requires_session: bool | None = None
    error: str | None = None


def probe_queue(client: ServiceBusClient, queue: str | Entity) -> QueueProbe:
    """Peek one message of a queue or subscription with a non-session receiver (nothing is locked,
    nothing changes).

    A session-enabled queue refuses that receiver, and the refusal itself proves it exists. A
    session receiver is not tried: it would lock a session (a worker's, or an empty one).
    """
    try:
        with as_entity(queue).receiver(client) as receiver:
            receiver.peek_messages(max_message_count=1)
        return QueueProbe(True, requires_session=False)
    except MessagingEntityNotFoundError:
        return QueueProbe(False)
    except (ServiceBusError, OSError, EnqueueError) as exc:
        if refuses_non_session(exc):
            return QueueProbe(True, requires_session=True)
        return QueueProbe(None, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")


def probe_topic(client: ServiceBusClient, topic: str) -> QueueProbe:
    """Whether a topic exists, with Send rights only: open a sender and ask for a batch (which
    needs the link's max message size), sending nothing."""
    try:
        with client.get_topic_sender(topic) as sender:
            sender.create_message_batch()
        return QueueProbe(True)
    except MessagingEntityNotFoundError:
        return QueueProbe(False)
    except (ServiceBusError, OSError, EnqueueError) as exc:
        return QueueProbe(None, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")


def queue_exists(client: ServiceBusClient, queue: str) -> bool | str:
    """True (a session-enabled queue too), False (unknown entity), or why it could not be checked."""
    probe = probe_queue(client, queue)
    return probe.exists if probe.exists is not None else probe.error or "unknown"
