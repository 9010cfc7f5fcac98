"""A topic: duplicate detection on send, then a copy to every subscription whose rules match.

Each subscription is an ordinary :class:`~sbemulator.queue.Queue` named
``topic/Subscriptions/name`` (with its own dead-letter queue, locks, delivery counts, sessions);
the topic only decides which subscriptions get a message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from sbemulator.config import QueueProperties
from sbemulator.dedup import DuplicateHistory
from sbemulator.entities import IncomingMessage
from sbemulator.errors import MessageNotFoundError, MessageSizeExceededError
from sbemulator.filters import MessageView, Rule
from sbemulator.queue import Queue

Placement = tuple[Queue, int]
MAX_TRACKED_SCHEDULED = 1000  # beyond this, forget scheduled messages that were enqueued meanwhile
Deliver = Callable[[Queue, IncomingMessage], list[Placement]]


@dataclass(frozen=True, slots=True)
class Subscription:
    """A subscription's queue and rules; no rules means the ``$Default`` true filter."""

    name: str
    queue: Queue
    rules: tuple[Rule, ...] = ()

    def matches(self, view: MessageView | None) -> bool:
        """True when any rule matches (a message matching several rules is delivered once)."""
        if not self.rules:
            return True
        assert view is not None
        return any(rule.matches(view) for rule in self.rules)


class Topic:
    """Send side of a topic. Not thread-safe: the server serialises access with a lock."""

    def __init__(self, name: str, props: QueueProperties, subscriptions: list[Subscription]) -> None:
        self.name = name
        self.props = props
        self.subscriptions = subscriptions
        self.next_seq = 1
        self._dedup = DuplicateHistory(
            props.requires_duplicate_detection, props.duplicate_detection_history_time_window
        )
        # Scheduled messages by the sequence number returned to the sender: where their copies went.
        self._scheduled: dict[int, list[Placement]] = {}

    def check_size(self, size: int) -> None:
        """Refuse a transfer above the topic's max message size."""
        if size > self.props.max_message_size:
            raise MessageSizeExceededError(
                f"The received message (size {size} bytes) exceeds the limit ({self.props.max_message_size} bytes)"
                f" of topic '{self.name}'; send smaller messages or raise MaxMessageSizeInKilobytes."
            )

    def publish(self, incoming: IncomingMessage, now: float, deliver: Deliver) -> int | None:
        """Copy a message to every matching subscription; None when dropped as a duplicate.

        Returns the topic's sequence number for the message (cancel-scheduled takes it back).
        """
        if self._dedup.is_duplicate(incoming.message_id, now):
            return None
        view = MessageView.of(incoming.payload) if any(s.rules for s in self.subscriptions) else None
        placements: list[Placement] = []
        for sub in self.subscriptions:
            if sub.matches(view):
                placements += deliver(sub.queue, incoming)
        self._dedup.remember(incoming.message_id, now)
        seq = self.next_seq
        self.next_seq += 1
        if incoming.scheduled_enqueue_time is not None and incoming.scheduled_enqueue_time > now:
            if len(self._scheduled) >= MAX_TRACKED_SCHEDULED:
                self._forget_enqueued()
            self._scheduled[seq] = placements
        return seq

    def _forget_enqueued(self) -> None:
        for seq in [s for s, places in self._scheduled.items() if not any(q.is_scheduled(n) for q, n in places)]:
            del self._scheduled[seq]

    def cancel_scheduled(self, seq: int) -> None:
        """Cancel a scheduled message in every subscription it went to."""
        placements = self._scheduled.pop(seq, None)
        if placements is None:
            raise MessageNotFoundError(f"no scheduled message with sequence number {seq} on topic '{self.name}'")
        for queue, queue_seq in placements:
            # Already enqueued in that subscription (or received): nothing left to cancel there.
            with contextlib.suppress(MessageNotFoundError):
                queue.cancel_scheduled([queue_seq])
