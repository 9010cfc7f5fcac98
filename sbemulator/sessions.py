"""Session locks and session state of one queue."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from sbemulator.config import QueueProperties
from sbemulator.entities import INFINITY, Journal, SessionRecord, StoredMessage
from sbemulator.errors import SessionCannotBeLockedError, SessionLockLostError


class SessionQueue(Protocol):
    """What a :class:`SessionTable` needs of its queue (:class:`sbemulator.queue.Queue` is one):
    declared here so the two modules do not import each other."""

    name: str
    props: QueueProperties
    journal: Journal

    @property
    def messages(self) -> Mapping[int, StoredMessage]: ...

    def ready_session_keys(self) -> list[str | None]: ...

    def unlock_session_messages(self, session_id: str, now: float) -> None: ...


class SessionTable:
    """Which receiver holds which session, until when, and each session's state blob.

    A lock lasts the queue's LockDuration and is renewed with renew-session-lock. When it
    expires (or its receiver detaches) the session's locked messages become available again
    and ``lost`` records the (session id, owner) so the AMQP layer can detach the receiver.
    """

    def __init__(self, queue: SessionQueue) -> None:
        self._queue = queue
        self.records: dict[str, SessionRecord] = {}
        self.lost: list[tuple[str, object]] = []

    def record(self, session_id: str) -> SessionRecord:
        """The session's record, created on first use."""
        rec = self.records.get(session_id)
        if rec is None:
            rec = self.records[session_id] = SessionRecord(session_id)
        return rec

    def touch(self, session_id: str) -> None:
        """Note that the session has messages."""
        self.record(session_id)

    def lock(self, session_id: str | None, owner: object, now: float) -> SessionRecord | None:
        """Lock a named session, or (``None``) any unlocked session with ready messages.

        Returns None when no session is available (the caller waits or times out).
        """
        if session_id is None:
            for key in self._queue.ready_session_keys():
                if key is not None and not self.record(key).locked_by_other(owner, now):
                    return self._grant(self.record(key), owner, now)
            return None
        rec = self.record(session_id)
        if rec.locked_by_other(owner, now):
            raise SessionCannotBeLockedError(
                f"The requested session '{session_id}' cannot be accepted. It may be locked by another receiver."
            )
        return self._grant(rec, owner, now)

    def _grant(self, rec: SessionRecord, owner: object, now: float) -> SessionRecord:
        rec.owner, rec.locked_until = owner, now + self._queue.props.lock_duration
        return rec

    def check(self, session_id: str, owner: object | None, now: float) -> SessionRecord:
        """The record, if ``owner`` (None: any live holder) holds its lock; else SessionLockLostError."""
        rec = self.records.get(session_id)
        held = rec is not None and rec.owner is not None and rec.locked_until > now
        if rec is None or not held or (owner is not None and rec.owner is not owner):
            raise SessionLockLostError(
                f"The session lock for '{session_id}' has expired or is held by another receiver; accept it again."
            )
        return rec

    def renew(self, session_id: str, owner: object | None, now: float) -> float:
        """Extend the session lock (and the locks of its locked messages)."""
        rec = self.check(session_id, owner, now)
        rec.locked_until = now + self._queue.props.lock_duration
        for msg in self._queue.messages.values():
            if msg.session_id == session_id and msg.lock_token is not None:
                msg.locked_until = rec.locked_until
        return rec.locked_until

    def release(self, session_id: str, owner: object, now: float) -> None:
        """The receiver detached: drop its lock and make its locked messages available."""
        rec = self.records.get(session_id)
        if rec is not None and rec.owner is owner:
            rec.owner, rec.locked_until = None, 0.0
            self._queue.unlock_session_messages(session_id, now)

    def locked_until(self, session_id: str | None) -> float:
        """When the session's lock ends (0 when unlocked)."""
        rec = self.records.get(session_id or "")
        return rec.locked_until if rec is not None else 0.0

    def set_state(self, session_id: str, state: bytes | None, now: float) -> None:
        """Store the session state blob."""
        rec = self.record(session_id)
        rec.state, rec.updated_at = state, now
        self._queue.journal.put_session(self._queue.name, rec)

    def active_ids(self, updated_since: float) -> list[str]:
        """Sessions with messages or state (get-message-sessions)."""
        with_messages = {m.session_id for m in self._queue.messages.values() if m.session_id is not None}
        ids = {k for k, r in self.records.items() if r.state is not None and r.updated_at >= updated_since}
        return sorted(with_messages | ids)

    def tick(self, now: float) -> None:
        """Expire session locks."""
        for rec in self.records.values():
            if rec.owner is not None and rec.locked_until <= now:
                owner = rec.owner
                rec.owner, rec.locked_until = None, 0.0
                self._queue.unlock_session_messages(rec.session_id, now)
                self.lost.append((rec.session_id, owner))

    def next_deadline(self) -> float:
        """Earliest session-lock expiry."""
        return min((r.locked_until for r in self.records.values() if r.owner is not None), default=INFINITY)
