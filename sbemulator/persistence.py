"""Optional persistence to SQLite (``--data-dir``): a restart loses no message.

Queue mutations are recorded in memory and written in one transaction at most every
``FLUSH_INTERVAL`` seconds and on shutdown (write-behind: a *hard* kill of the emulator may lose
the last fraction of a second; a clean stop loses nothing). Locks are not persisted: after a
restart every message is available again, like after a lock expiry.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sbemulator.config import QueueProperties, TopicConfig
from sbemulator.entities import MessageState, SessionRecord, StoredMessage

if TYPE_CHECKING:
    from sbemulator.broker import Broker

FLUSH_INTERVAL = 0.05
DB_NAME = "sbemulator.sqlite3"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS queues (name TEXT PRIMARY KEY, props TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS topics (name TEXT PRIMARY KEY, config TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    queue TEXT NOT NULL, seq INTEGER NOT NULL, payload BLOB NOT NULL, message_id TEXT, session_id TEXT,
    enqueued_at REAL NOT NULL, expires_at REAL NOT NULL, state INTEGER NOT NULL, delivery_count INTEGER NOT NULL,
    scheduled_at REAL, ttl REAL, dl_reason TEXT, dl_description TEXT, dl_source TEXT,
    PRIMARY KEY (queue, seq));
CREATE TABLE IF NOT EXISTS sessions (
    queue TEXT NOT NULL, session_id TEXT NOT NULL, state BLOB, updated_at REAL NOT NULL,
    PRIMARY KEY (queue, session_id));
"""


class SqliteJournal:
    """Write-behind journal of queue contents in ``data_dir/sbemulator.sqlite3``."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / DB_NAME
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._messages: dict[tuple[str, int], StoredMessage | None] = {}
        self._sessions: dict[tuple[str, str], SessionRecord] = {}
        self._last_flush = time.monotonic()

    # ---- Journal protocol ----------------------------------------------------------------
    def put_message(self, queue: str, msg: StoredMessage) -> None:
        """Record the message's current state (written at the next flush)."""
        self._messages[(queue, msg.seq)] = msg

    def delete_message(self, queue: str, seq: int) -> None:
        """Record the message's removal."""
        self._messages[(queue, seq)] = None

    def put_session(self, queue: str, record: SessionRecord) -> None:
        """Record a session's state blob."""
        self._sessions[(queue, record.session_id)] = record

    @property
    def dirty(self) -> bool:
        """True while writes wait for a flush."""
        return bool(self._messages or self._sessions)

    def flush_if_due(self) -> None:
        """Flush when FLUSH_INTERVAL has passed since the last flush."""
        if self.dirty and time.monotonic() - self._last_flush >= FLUSH_INTERVAL:
            self.flush()

    def flush(self) -> None:
        """Write everything recorded so far in one transaction."""
        self._last_flush = time.monotonic()
        if not self.dirty:
            return
        messages, self._messages = self._messages, {}
        sessions, self._sessions = self._sessions, {}
        upserts = [_row(q, m) for (q, _), m in messages.items() if m is not None]
        deletes = [(q, s) for (q, s), m in messages.items() if m is None]
        with self._transaction():
            self._db.executemany("DELETE FROM messages WHERE queue=? AND seq=?", deletes)
            self._db.executemany("INSERT OR REPLACE INTO messages VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", upserts)
            self._db.executemany(
                "INSERT OR REPLACE INTO sessions VALUES (?,?,?,?)",
                [(q, r.session_id, r.state, r.updated_at) for (q, _), r in sessions.items()],
            )

    def put_queue(self, name: str, props: QueueProperties) -> None:
        """Remember a queue created at runtime so a restart recreates it."""
        with self._transaction():
            self._db.execute(
                "INSERT OR REPLACE INTO queues VALUES (?,?)", (name, json.dumps(dataclasses.asdict(props)))
            )

    def put_topic(self, name: str, config: Mapping[str, Any]) -> None:
        """Remember a topic created at runtime (its Config.json object) so a restart recreates it."""
        with self._transaction():
            self._db.execute("INSERT OR REPLACE INTO topics VALUES (?,?)", (name, json.dumps(config)))

    def close(self) -> None:
        """Flush and close the database."""
        self.flush()
        self._db.close()

    # ---- restore -------------------------------------------------------------------------
    def restore(self, broker: Broker) -> None:
        """Recreate runtime-created queues and topics, reload every message and session state.

        Subscriptions are queues (``topic/Subscriptions/name``): their messages come back the same way.
        """
        for name, props in self._db.execute("SELECT name, props FROM queues"):
            broker.create_queue(name, QueueProperties(**json.loads(props)))
        for (config,) in self._db.execute("SELECT config FROM topics"):
            broker.create_topic(TopicConfig.from_json(json.loads(config), where="persisted topic"))
        for row in self._db.execute("SELECT * FROM messages ORDER BY queue, seq"):
            queue = broker.queue(row[0])
            queue.restore(_message(row))
        for queue_name, session_id, state, updated_at in self._db.execute("SELECT * FROM sessions"):
            rec = broker.queue(queue_name).sessions.record(session_id)
            rec.state, rec.updated_at = state, updated_at

    def _transaction(self) -> sqlite3.Connection:
        return _Tx(self._db)  # type: ignore[return-value]


class _Tx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")


def _row(queue: str, m: StoredMessage) -> tuple[object, ...]:
    return (
        queue,
        m.seq,
        m.payload,
        m.message_id,
        m.session_id,
        m.enqueued_at,
        m.expires_at,
        int(m.state),
        m.delivery_count,
        m.scheduled_at,
        m.ttl,
        m.dead_letter_reason,
        m.dead_letter_description,
        m.dead_letter_source,
    )


def _message(row: tuple[object, ...]) -> StoredMessage:
    (
        _,
        seq,
        payload,
        message_id,
        session_id,
        enqueued_at,
        expires_at,
        state,
        delivery_count,
        scheduled_at,
        ttl,
        reason,
        description,
        source,
    ) = row
    return StoredMessage(
        seq=int(seq),  # type: ignore[call-overload]
        payload=bytes(payload),  # type: ignore[call-overload]
        message_id=message_id,  # type: ignore[arg-type]
        session_id=session_id,  # type: ignore[arg-type]
        enqueued_at=float(enqueued_at),  # type: ignore[arg-type]
        expires_at=float(expires_at),  # type: ignore[arg-type]
        state=MessageState(state),  # type: ignore[arg-type]
        delivery_count=int(delivery_count),  # type: ignore[call-overload]
        scheduled_at=scheduled_at,  # type: ignore[arg-type]
        ttl=ttl,  # type: ignore[arg-type]
        dead_letter_reason=reason,  # type: ignore[arg-type]
        dead_letter_description=description,  # type: ignore[arg-type]
        dead_letter_source=source,  # type: ignore[arg-type]
    )
