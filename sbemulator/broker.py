"""The namespace: queues and topics by name, sub-queue paths, forwarding and dead-letter routing.

A topic's subscriptions are queues named ``topic/Subscriptions/name``: receivers, the dead-letter
sub-queue and ``$management`` address them exactly like queues.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from sbemulator.config import EmulatorConfig, QueueProperties, TopicConfig, subscription_path
from sbemulator.entities import INFINITY, IncomingMessage, Journal, NullJournal, StoredMessage
from sbemulator.errors import EntityNotFoundError, InvalidOperationError
from sbemulator.queue import Queue
from sbemulator.topic import Placement, Subscription, Topic

Entity = Queue | Topic

DLQ_SUFFIXES = ("/$deadletterqueue", "/$transfer/$deadletterqueue")
MAX_FORWARD_HOPS = 4


@dataclass(frozen=True, slots=True)
class EntityPath:
    """A parsed entity address: queue name, and whether it names the dead-letter sub-queue."""

    queue: str
    dead_letter: bool = False
    management: bool = False

    @classmethod
    def parse(cls, address: str) -> EntityPath:
        """Accept ``amqps://host:port/q/$DeadLetterQueue``, ``q/$management`` and the like."""
        path = address
        if "://" in path:
            path = path.split("://", 1)[1]
            path = path.split("/", 1)[1] if "/" in path else ""
        path = path.strip("/")
        lower = path.lower()
        management = lower.endswith("/$management")
        if management:
            path, lower = path[: -len("/$management")], lower[: -len("/$management")]
        for suffix in DLQ_SUFFIXES:
            if lower.endswith(suffix):
                return cls(path[: -len(suffix)], True, management)
        return cls(path, False, management)


class Broker:
    """All queues of the namespace. Not thread-safe: the server serialises access with a lock."""

    def __init__(
        self,
        config: EmulatorConfig,
        *,
        journal: Journal | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.namespace = config.namespace
        self.journal: Journal = journal or NullJournal()
        self.clock = clock
        self._queues: dict[str, Queue] = {}
        self._dlqs: dict[str, Queue] = {}
        self._topics: dict[str, Topic] = {}
        for q in config.queues:
            self.create_queue(q.name, q.properties)
        for t in config.topics:
            self.create_topic(t)

    def create_queue(self, name: str, props: QueueProperties | None = None) -> Queue:
        """Add a queue (and its dead-letter queue); an existing queue keeps its messages."""
        key = name.lower()
        if key in self._queues:
            return self._queues[key]
        props = props or QueueProperties()
        dlq = Queue(f"{name}/$DeadLetterQueue", props, is_dead_letter=True, journal=self.journal)
        main = Queue(name, props, journal=self.journal, dead_letter_sink=self._route_dead_letter)
        self._queues[key], self._dlqs[key] = main, dlq
        return main

    def create_topic(self, config: TopicConfig) -> Topic:
        """Add a topic and its subscriptions; an existing topic is kept as it is."""
        key = config.name.lower()
        if key in self._topics:
            return self._topics[key]
        if key in self._queues:
            raise InvalidOperationError(f"'{config.name}' is a queue already; topic and queue names share a namespace")
        subs = [
            Subscription(s.name, self.create_queue(subscription_path(config.name, s.name), s.properties), s.rules)
            for s in config.subscriptions
        ]
        topic = self._topics[key] = Topic(config.name, config.properties, subs)
        return topic

    def topics(self) -> Iterator[Topic]:
        """Every topic."""
        yield from self._topics.values()

    def queue(self, path: str | EntityPath) -> Queue:
        """The queue, subscription or dead-letter queue an address names; EntityNotFoundError otherwise."""
        ep = path if isinstance(path, EntityPath) else EntityPath.parse(path)
        key = ep.queue.lower()
        table = self._dlqs if ep.dead_letter else self._queues
        if key not in table:
            if key in self._topics and not ep.dead_letter:
                raise InvalidOperationError(
                    f"'{ep.queue}' is a topic: receive from one of its subscriptions,"
                    f" '{ep.queue}/Subscriptions/<name>' (get_subscription_receiver)."
                )
            kind = "subscription" if "/subscriptions/" in key else "queue"
            raise EntityNotFoundError(
                f"The messaging entity '{self.namespace}:{kind}:{ep.queue}' could not be found;"
                " start the emulator with `dbfanout emulator servicebus --app-config dbfanout.toml` (it declares"
                " the app's queues and topics; `dbfanout run` does that itself), or add it to Config.json"
                " (or Emulator.create_queue / create_topic)."
            )
        return table[key]

    def entity(self, path: str | EntityPath) -> Entity:
        """The topic an address names, else its queue/subscription (as :meth:`queue`)."""
        ep = path if isinstance(path, EntityPath) else EntityPath.parse(path)
        topic = None if ep.dead_letter else self._topics.get(ep.queue.lower())
        return topic if topic is not None else self.queue(ep)

    def queues(self) -> Iterator[Queue]:
        """Every queue and dead-letter queue."""
        for key, main in self._queues.items():
            yield main
            yield self._dlqs[key]

    def send(self, path: str | EntityPath, messages: Sequence[IncomingMessage], transfer_size: int) -> list[int | None]:
        """Enqueue one transfer's messages (following ForwardTo, fanning out topics).

        Returns each message's sequence number (the topic's, for a topic); None marks a dropped
        duplicate.
        """
        entity = self.sendable(path)
        entity.check_size(transfer_size)
        now = self.clock()
        return [self.enqueue(entity, m, now) for m in messages]

    def sendable(self, path: str | EntityPath) -> Entity:
        """The queue or topic senders may address; InvalidOperationError for DLQs and subscriptions."""
        entity = self.entity(path)
        if isinstance(entity, Queue) and entity.is_dead_letter:
            raise InvalidOperationError("cannot send to a dead-letter queue")
        if isinstance(entity, Queue) and self._is_subscription(entity):
            raise InvalidOperationError(f"cannot send to subscription '{entity.name}': send to its topic")
        return entity

    def enqueue(self, entity: Entity, message: IncomingMessage, now: float) -> int | None:
        """Store one message in a queue, or publish it on a topic; None for a dropped duplicate."""
        if isinstance(entity, Topic):
            return entity.publish(message, now, lambda q, m: self._place(q, m, now, 1))
        placed = self._place(entity, message, now, 0)
        return placed[0][1] if placed else None

    def _place(self, queue: Queue, message: IncomingMessage, now: float, hops: int) -> list[Placement]:
        """Enqueue into ``queue`` or where its ForwardTo leads (a queue or a topic)."""
        while queue.props.forward_to and hops < MAX_FORWARD_HOPS:
            hops += 1
            target = self.entity(queue.props.forward_to)
            if isinstance(target, Topic):
                return self._publish_forwarded(target, message, now, hops)
            queue = target
        seq = queue.enqueue(message, now)
        return [] if seq is None else [(queue, seq)]

    def _publish_forwarded(self, topic: Topic, message: IncomingMessage, now: float, hops: int) -> list[Placement]:
        placed: list[Placement] = []

        def deliver(queue: Queue, m: IncomingMessage) -> list[Placement]:
            got = self._place(queue, m, now, hops)
            placed.extend(got)
            return got

        topic.publish(message, now, deliver)
        return placed

    def _is_subscription(self, queue: Queue) -> bool:
        topic, sep, _ = queue.name.lower().partition("/subscriptions/")
        return bool(sep) and topic in self._topics

    def tick(self) -> None:
        """Apply lock expiry, schedules and TTL on every queue."""
        now = self.clock()
        for q in self.queues():
            if q.next_deadline() <= now:
                q.tick(now)

    def next_deadline(self) -> float:
        """When :meth:`tick` next has work."""
        return min((q.next_deadline() for q in self.queues()), default=INFINITY)

    def _route_dead_letter(self, msg: StoredMessage, now: float) -> None:
        source = self._queues[msg.dead_letter_source.lower()] if msg.dead_letter_source else None
        target_name = source.props.forward_dead_lettered_messages_to if source else ""
        if target_name:
            target = self.entity(target_name)
            if isinstance(target, Topic):  # dead letters forwarded to a topic are published there
                self.enqueue(target, IncomingMessage(msg.payload, msg.message_id, msg.session_id, msg.ttl), now)
            else:
                target.accept_dead_letter(msg, now)
        elif source is not None:
            self._dlqs[source.name.lower()].accept_dead_letter(msg, now)
