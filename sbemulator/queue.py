"""One queue (or its dead-letter sub-queue): Service Bus semantics without AMQP.

Every method takes ``now`` (unix seconds) so tests drive time explicitly. Readiness is a heap of
sequence numbers per session key (``None`` for queues without sessions); entries go stale when a
message is locked or removed and are skipped lazily, which keeps every operation O(log n).
"""

from __future__ import annotations

import heapq
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sbemulator.config import QueueProperties
from sbemulator.dedup import DuplicateHistory
from sbemulator.entities import (
    INFINITY,
    IncomingMessage,
    Journal,
    MessageState,
    NullJournal,
    StoredMessage,
)
from sbemulator.errors import (
    InvalidOperationError,
    MessageLockLostError,
    MessageNotFoundError,
    MessageSizeExceededError,
    QuotaExceededError,
    quota_exceeded_text,
)
from sbemulator.sessions import SessionTable

MAX_DELIVERY_REASON = "MaxDeliveryCountExceeded"
TTL_REASON = "TTLExpiredException"

DeadLetterSink = Callable[[StoredMessage, float], None]


@dataclass(frozen=True, slots=True)
class Delivery:
    """A message handed to a receiver; ``lock_token`` is None in receive-and-delete mode."""

    message: StoredMessage
    lock_token: uuid.UUID | None
    locked_until: float


class Queue:
    """Messages, locks, schedule, TTL and duplicate history of one entity."""

    def __init__(
        self,
        name: str,
        props: QueueProperties,
        *,
        is_dead_letter: bool = False,
        journal: Journal | None = None,
        dead_letter_sink: DeadLetterSink | None = None,
    ) -> None:
        self.name = name
        self.props = props
        self.is_dead_letter = is_dead_letter
        self.journal: Journal = journal or NullJournal()
        self.dead_letter_sink = dead_letter_sink
        self.messages: dict[int, StoredMessage] = {}
        self.sessions = SessionTable(self)
        self.next_seq = 1
        self.bytes = 0
        self._ready: dict[str | None, list[int]] = {}
        self._locks: dict[uuid.UUID, StoredMessage] = {}
        self._lock_heap: list[tuple[float, int, uuid.UUID]] = []
        self._ttl_heap: list[tuple[float, int]] = []
        self._scheduled_heap: list[tuple[float, int]] = []
        enabled = props.requires_duplicate_detection and not is_dead_letter
        self._dedup = DuplicateHistory(enabled, props.duplicate_detection_history_time_window)
        self.version = 0  # bumped whenever a message may have become ready (wakes dispatch)

    # ---- sending -------------------------------------------------------------------------
    def check_size(self, size: int) -> None:
        """Refuse a transfer above the queue's max message size."""
        if size > self.props.max_message_size:
            raise MessageSizeExceededError(
                f"The received message (size {size} bytes) exceeds the limit ({self.props.max_message_size} bytes)"
                f" of queue '{self.name}'; send smaller messages or raise MaxMessageSizeInKilobytes."
            )

    def enqueue(self, incoming: IncomingMessage, now: float) -> int | None:
        """Store a message; returns its sequence number, or None when dropped as a duplicate."""
        if self.props.requires_session and incoming.session_id is None and not self.is_dead_letter:
            raise InvalidOperationError(f"queue '{self.name}' requires sessions: set session_id on every message")
        if self._dedup.is_duplicate(incoming.message_id, now):
            return None
        self._check_quota(incoming.size)
        self._dedup.remember(incoming.message_id, now)
        msg = StoredMessage(
            seq=self._take_seq(),
            payload=incoming.payload,
            message_id=incoming.message_id,
            session_id=incoming.session_id,
            enqueued_at=now,
            expires_at=INFINITY,
            ttl=incoming.ttl,
        )
        due = incoming.scheduled_enqueue_time
        if due is not None and due > now:
            msg.state, msg.scheduled_at = MessageState.SCHEDULED, due
            heapq.heappush(self._scheduled_heap, (due, msg.seq))
            self._store(msg)
        else:
            self._store(msg)
            self._activate(msg, now)
        return msg.seq

    def accept_dead_letter(self, msg: StoredMessage, now: float) -> None:
        """Take a dead-lettered message (this is a DLQ, or a ForwardDeadLetteredMessagesTo target).

        Never refused for quota: refusing would lose the message.
        """
        if not self.is_dead_letter or msg.seq in self.messages:
            msg.seq = self._take_seq()
        else:
            self.next_seq = max(self.next_seq, msg.seq + 1)
        msg.state, msg.lock_token, msg.in_ready = MessageState.ACTIVE, None, False
        msg.expires_at = INFINITY
        self._store(msg)
        self._activate(msg, now)

    def restore(self, msg: StoredMessage) -> None:
        """Reload a persisted message (unlocked) with its sequence number and state."""
        msg.lock_token, msg.in_ready = None, False
        self.messages[msg.seq] = msg
        self.bytes += msg.size
        self.next_seq = max(self.next_seq, msg.seq + 1)
        if msg.state is MessageState.SCHEDULED and msg.scheduled_at is not None:
            heapq.heappush(self._scheduled_heap, (msg.scheduled_at, msg.seq))
            return
        if msg.expires_at != INFINITY:
            heapq.heappush(self._ttl_heap, (msg.expires_at, msg.seq))
        self._make_ready(msg)

    def is_scheduled(self, seq: int) -> bool:
        """True while the message ``seq`` waits for its scheduled enqueue time."""
        msg = self.messages.get(seq)
        return msg is not None and msg.state is MessageState.SCHEDULED

    def cancel_scheduled(self, seqs: Iterable[int]) -> None:
        """Drop scheduled messages; unknown or already enqueued ones raise MessageNotFoundError."""
        for seq in seqs:
            msg = self.messages.get(seq)
            if msg is None or msg.state is not MessageState.SCHEDULED:
                raise MessageNotFoundError(f"no scheduled message with sequence number {seq}")
            self._remove(msg)

    # ---- receiving -----------------------------------------------------------------------
    def lock_next(self, session_key: str | None, now: float, *, delete: bool = False) -> Delivery | None:
        """The next ready message of a session key, locked (peek-lock) or removed (delete=True)."""
        heap = self._ready.get(session_key)
        while heap:
            msg = self.messages.get(heapq.heappop(heap))
            if msg is None or not msg.in_ready:
                continue
            msg.in_ready = False
            if msg.expires_at <= now:
                self._expire(msg, now)
                continue
            return self._hand_out(msg, now, delete)
        return None

    def has_ready(self, session_key: str | None) -> bool:
        """True when lock_next would find a message for this key (cleans stale heap entries)."""
        heap = self._ready.get(session_key)
        while heap:
            msg = self.messages.get(heap[0])
            if msg is not None and msg.in_ready:
                return True
            heapq.heappop(heap)
        return False

    def ready_session_keys(self) -> list[str | None]:
        """Session keys with at least one ready message."""
        return [k for k in list(self._ready) if self.has_ready(k)]

    def lock_deferred(self, seqs: Iterable[int], now: float, *, delete: bool = False) -> list[Delivery]:
        """receive-by-sequence-number: lock (or remove) deferred messages."""
        found = []
        for seq in seqs:
            msg = self.messages.get(seq)
            if msg is None or msg.state is not MessageState.DEFERRED or msg.lock_token is not None:
                raise MessageNotFoundError(f"no deferred message with sequence number {seq} is available")
            found.append(msg)
        return [self._hand_out(m, now, delete) for m in found]

    def peek(self, from_seq: int, count: int, session_id: str | None = None) -> list[StoredMessage]:
        """Up to ``count`` messages from ``from_seq`` on, in sequence order, without locking."""
        seqs = sorted(s for s in self.messages if s >= from_seq)
        out = []
        for seq in seqs:
            msg = self.messages[seq]
            if session_id is None or msg.session_id == session_id:
                out.append(msg)
                if len(out) >= count:
                    break
        return out

    # ---- settlement ----------------------------------------------------------------------
    def locked(self, token: uuid.UUID, now: float) -> StoredMessage:
        """The message a live lock token refers to, or MessageLockLostError."""
        msg = self._locks.get(token)
        if msg is None or (msg.locked_until <= now and not self._session_locked(msg)):
            raise MessageLockLostError(
                "The lock supplied is invalid. Either the lock expired, or the message has already been"
                " removed from the queue; the message is redelivered."
            )
        return msg

    def complete(self, token: uuid.UUID, now: float) -> None:
        """Remove a locked message."""
        self._remove(self.locked(token, now))

    def abandon(self, token: uuid.UUID, now: float) -> None:
        """Unlock with delivery count + 1 (dead-letters at MaxDeliveryCount)."""
        self._unlock(self.locked(token, now), now, increment=True)

    def release(self, token: uuid.UUID, now: float) -> None:
        """Unlock without counting a delivery attempt (client released a prefetched message)."""
        self._unlock(self.locked(token, now), now, increment=False)

    def defer(self, token: uuid.UUID, now: float) -> None:
        """Set aside: only receive-by-sequence-number returns it."""
        msg = self.locked(token, now)
        self._drop_lock(msg)
        msg.state = MessageState.DEFERRED
        self.journal.put_message(self.name, msg)

    def dead_letter(self, token: uuid.UUID, reason: str | None, description: str | None, now: float) -> None:
        """Move a locked message to the dead-letter queue with reason and description."""
        if self.is_dead_letter:
            raise InvalidOperationError("a message in a dead-letter queue cannot be dead-lettered again")
        msg = self.locked(token, now)
        self._drop_lock(msg)
        self._to_dead_letter(msg, reason, description, now)

    def renew(self, token: uuid.UUID, now: float) -> float:
        """Extend a lock by LockDuration; returns the new locked-until."""
        msg = self.locked(token, now)
        msg.locked_until = now + self.props.lock_duration
        heapq.heappush(self._lock_heap, (msg.locked_until, msg.seq, token))
        return msg.locked_until

    def unlock_session_messages(self, session_id: str, now: float) -> None:
        """A session lock ended: its locked messages become available (delivery count + 1)."""
        for msg in [m for m in self._locks.values() if m.session_id == session_id]:
            self._unlock(msg, now, increment=True)

    # ---- time ----------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Apply everything due by ``now``: lock expiry, scheduled enqueue, TTL, dedup history."""
        while self._lock_heap and self._lock_heap[0][0] <= now:
            until, _, token = heapq.heappop(self._lock_heap)
            msg = self._locks.get(token)
            if msg is not None and msg.locked_until == until and not self._session_locked(msg):
                self._unlock(msg, now, increment=True)
        while self._scheduled_heap and self._scheduled_heap[0][0] <= now:
            _, seq = heapq.heappop(self._scheduled_heap)
            msg = self.messages.get(seq)
            if msg is not None and msg.state is MessageState.SCHEDULED:
                # Like the service: a scheduled message is enqueued when it becomes available.
                msg.enqueued_at = msg.scheduled_at or now
                msg.state, msg.scheduled_at = MessageState.ACTIVE, None
                self.journal.put_message(self.name, msg)
                self._activate(msg, now)
        while self._ttl_heap and self._ttl_heap[0][0] <= now:
            _, seq = heapq.heappop(self._ttl_heap)
            msg = self.messages.get(seq)
            if msg is not None and msg.lock_token is None and msg.expires_at <= now:
                self._expire(msg, now)
        self.sessions.tick(now)
        self._dedup.prune(now)

    def next_deadline(self) -> float:
        """When tick next has work (INFINITY if never)."""
        heads = [h[0][0] for h in (self._lock_heap, self._scheduled_heap, self._ttl_heap) if h]
        return min([*heads, self.sessions.next_deadline()], default=INFINITY)

    # ---- internals -----------------------------------------------------------------------
    def _take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def _store(self, msg: StoredMessage) -> None:
        self.messages[msg.seq] = msg
        self.bytes += msg.size
        self.journal.put_message(self.name, msg)

    def _activate(self, msg: StoredMessage, now: float) -> None:
        if not self.is_dead_letter and msg.expires_at == INFINITY:
            ttl = min(msg.ttl or INFINITY, self.props.default_message_time_to_live)
            msg.expires_at = now + ttl
            heapq.heappush(self._ttl_heap, (msg.expires_at, msg.seq))
        self._make_ready(msg)

    def _make_ready(self, msg: StoredMessage) -> None:
        if msg.in_ready or msg.state is not MessageState.ACTIVE:
            return
        msg.in_ready = True
        key = msg.session_id if self.props.requires_session and not self.is_dead_letter else None  # a DLQ never is
        heapq.heappush(self._ready.setdefault(key, []), msg.seq)
        self.version += 1
        if key is not None:
            self.sessions.touch(key)

    def _hand_out(self, msg: StoredMessage, now: float, delete: bool) -> Delivery:
        if delete:
            self._remove(msg)
            return Delivery(msg, None, 0.0)
        token = uuid.uuid4()
        msg.lock_token = token
        msg.locked_until = now + self.props.lock_duration
        if self._session_locked(msg):
            msg.locked_until = self.sessions.locked_until(msg.session_id)
        else:
            heapq.heappush(self._lock_heap, (msg.locked_until, msg.seq, token))
        self._locks[token] = msg
        return Delivery(msg, token, msg.locked_until)

    def _session_locked(self, msg: StoredMessage) -> bool:
        return self.props.requires_session and not self.is_dead_letter and msg.session_id is not None

    def _drop_lock(self, msg: StoredMessage) -> None:
        if msg.lock_token is not None:
            self._locks.pop(msg.lock_token, None)
            msg.lock_token = None

    def _unlock(self, msg: StoredMessage, now: float, *, increment: bool) -> None:
        self._drop_lock(msg)
        if increment:
            msg.delivery_count += 1
            if msg.delivery_count >= self.props.max_delivery_count and not self.is_dead_letter:
                count = self.props.max_delivery_count
                self._to_dead_letter(
                    msg, MAX_DELIVERY_REASON, f"Message could not be consumed after {count} delivery attempts.", now
                )
                return
            self.journal.put_message(self.name, msg)
        if msg.expires_at <= now:
            self._expire(msg, now)
        else:
            self._make_ready(msg)

    def _remove(self, msg: StoredMessage) -> None:
        self._drop_lock(msg)
        msg.in_ready = False
        if self.messages.pop(msg.seq, None) is not None:
            self.bytes -= msg.size
            self.journal.delete_message(self.name, msg.seq)

    def _expire(self, msg: StoredMessage, now: float) -> None:
        if self.props.dead_lettering_on_message_expiration:
            self._to_dead_letter(msg, TTL_REASON, "The message expired and was dead lettered.", now)
        else:
            self._remove(msg)

    def _to_dead_letter(self, msg: StoredMessage, reason: str | None, desc: str | None, now: float) -> None:
        self._remove(msg)
        if self.dead_letter_sink is None:
            return
        msg.dead_letter_reason, msg.dead_letter_description = reason, desc
        msg.dead_letter_source = self.name
        self.dead_letter_sink(msg, now)

    def _check_quota(self, size: int) -> None:
        if self.bytes + size > self.props.max_size_bytes:
            raise QuotaExceededError(quota_exceeded_text(self.name, self.bytes + size, self.props.max_size_bytes))
