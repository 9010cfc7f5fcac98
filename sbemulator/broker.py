"""The namespace: queues by name, sub-queue paths, forwarding and dead-letter routing."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from sbemulator.config import EmulatorConfig, QueueProperties
from sbemulator.entities import INFINITY, IncomingMessage, Journal, NullJournal, StoredMessage
from sbemulator.errors import EntityNotFoundError, InvalidOperationError
from sbemulator.queue import Queue

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
        for q in config.queues:
            self.create_queue(q.name, q.properties)

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

    def queue(self, path: str | EntityPath) -> Queue:
        """The queue (or DLQ) an address names; EntityNotFoundError otherwise."""
        ep = path if isinstance(path, EntityPath) else EntityPath.parse(path)
        key = ep.queue.lower()
        table = self._dlqs if ep.dead_letter else self._queues
        if key not in table:
            raise EntityNotFoundError(
                f"The messaging entity '{self.namespace}:queue:{ep.queue}' could not be found;"
                " add it to Config.json (or Emulator.create_queue)."
            )
        return table[key]

    def queues(self) -> Iterator[Queue]:
        """Every queue and dead-letter queue."""
        for key, main in self._queues.items():
            yield main
            yield self._dlqs[key]

    def send(self, path: str | EntityPath, messages: Sequence[IncomingMessage], transfer_size: int) -> list[int | None]:
        """Enqueue one transfer's messages (following ForwardTo); None marks a dropped duplicate."""
        queue = self.queue(path)
        if queue.is_dead_letter:
            raise InvalidOperationError("cannot send to a dead-letter queue")
        queue.check_size(transfer_size)
        queue = self._forward_target(queue)
        now = self.clock()
        return [queue.enqueue(m, now) for m in messages]

    def tick(self) -> None:
        """Apply lock expiry, schedules and TTL on every queue."""
        now = self.clock()
        for q in self.queues():
            if q.next_deadline() <= now:
                q.tick(now)

    def next_deadline(self) -> float:
        """When :meth:`tick` next has work."""
        return min((q.next_deadline() for q in self.queues()), default=INFINITY)

    def _forward_target(self, queue: Queue) -> Queue:
        for _ in range(MAX_FORWARD_HOPS):
            if not queue.props.forward_to:
                return queue
            queue = self.queue(queue.props.forward_to)
        return queue

    def _route_dead_letter(self, msg: StoredMessage, now: float) -> None:
        source = self._queues[msg.dead_letter_source.lower()] if msg.dead_letter_source else None
        target_name = source.props.forward_dead_lettered_messages_to if source else ""
        if target_name:
            self.queue(target_name).accept_dead_letter(msg, now)
        elif source is not None:
            self._dlqs[source.name.lower()].accept_dead_letter(msg, now)
