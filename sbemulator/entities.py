"""The values the broker keeps: incoming messages, stored messages, session records.

The broker never looks inside ``payload`` (the encoded AMQP message as the client sent it); the
AMQP layer extracts the few fields the broker needs into :class:`IncomingMessage` and stamps
broker state (sequence number, lock, delivery count, dead-letter reason) when it delivers.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from typing import Protocol

INFINITY = float("inf")


class MessageState(enum.IntEnum):
    """Values of the ``x-opt-message-state`` annotation."""

    ACTIVE = 0
    DEFERRED = 1
    SCHEDULED = 2


class _Sized:
    """``size``: the bytes of ``payload`` counted against size limits and the queue quota."""

    __slots__ = ()
    payload: bytes

    @property
    def size(self) -> int:
        """Bytes counted against size limits and quotas."""
        return len(self.payload)


@dataclass(frozen=True, slots=True)
class IncomingMessage(_Sized):
    """What the broker needs to know about one message a client sends."""

    payload: bytes
    message_id: str | None = None
    session_id: str | None = None
    ttl: float | None = None
    scheduled_enqueue_time: float | None = None


@dataclass(slots=True)
class StoredMessage(_Sized):
    """A message inside a queue. Mutable: it is broker state, owned by exactly one queue."""

    seq: int
    payload: bytes
    message_id: str | None
    session_id: str | None
    enqueued_at: float
    expires_at: float
    state: MessageState = MessageState.ACTIVE
    delivery_count: int = 0
    scheduled_at: float | None = None
    ttl: float | None = None
    dead_letter_reason: str | None = None
    dead_letter_description: str | None = None
    dead_letter_source: str | None = None
    lock_token: uuid.UUID | None = None
    locked_until: float = 0.0
    in_ready: bool = False


@dataclass(slots=True)
class SessionRecord:
    """Per-session state and lock. ``owner`` is an opaque token of the receiving link."""

    session_id: str
    state: bytes | None = None
    owner: object | None = None
    locked_until: float = 0.0
    updated_at: float = 0.0

    def locked_by_other(self, owner: object, now: float) -> bool:
        """True when another live receiver holds the lock."""
        return self.owner is not None and self.owner is not owner and self.locked_until > now


class Journal(Protocol):
    """Where queue mutations go to be persisted (see :mod:`sbemulator.persistence`)."""

    def put_message(self, queue: str, msg: StoredMessage) -> None: ...

    def delete_message(self, queue: str, seq: int) -> None: ...

    def put_session(self, queue: str, record: SessionRecord) -> None: ...

    def flush_if_due(self) -> None: ...


class NullJournal:
    """Keeps nothing: the default, in-memory emulator."""

    def put_message(self, queue: str, msg: StoredMessage) -> None:
        return None

    def delete_message(self, queue: str, seq: int) -> None:
        return None

    def put_session(self, queue: str, record: SessionRecord) -> None:
        return None

    def flush_if_due(self) -> None:
        return None
