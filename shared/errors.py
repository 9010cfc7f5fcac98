"""The dbfanout error hierarchy.

Every error says what went wrong (the message), whether trying again can help (``retryable``)
and what to do about it (``hint``). Lifecycle errors also name the failure window (W1-W7 of
the operations guide) they belong to.

    DbFanoutError
    ├── ConfigError                 bad dbfanout.toml / settings; fails at load or indexing
    ├── SourceError                 the database side
    │   ├── FetchError              the query failed (database down, SQL error)
    │   ├── CursorError             a cursor value we cannot order by (naive, NULL, wrong type)
    │   ├── PositionLostError       the source's log no longer holds the changes after the checkpoint
    │   └── SchemaChangeError       a migration changed the cursor or a key column (an operator decision)
    ├── SerializationError          a value, state blob or message we cannot encode/decode
    │   ├── StateFormatError        corrupt or unknown-version state blob
    │   └── EnvelopeError           malformed or foreign Service Bus message body
    ├── StateError                  the state store (blob) side
    │   ├── StateUnavailableError   storage unreachable / auth failure
    │   └── FingerprintMismatchError  the source definition changed under a checkpoint
    ├── LeaseError
    │   └── LostLeaseError          another owner took the lease (W4): stop, do not commit
    ├── CommitError                 the checkpoint write failed (W1)
    │   └── CommitAmbiguousError    the write may or may not have landed (W5)
    ├── EnqueueError                the broker did not accept every message of a batch
    │   ├── BrokerRefusingError     the broker refuses for now: queue full, throttled, unreachable
    │   └── OversizeRowError        one row does not fit in a message
    └── HandlerError                a user handler raised
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "BrokerRefusingError",
    "CommitAmbiguousError",
    "CommitError",
    "ConfigError",
    "CursorError",
    "DbFanoutError",
    "EnqueueError",
    "EnvelopeError",
    "FetchError",
    "FingerprintMismatchError",
    "HandlerError",
    "LeaseError",
    "LostLeaseError",
    "OversizeRowError",
    "PositionLostError",
    "RefusalReason",
    "SchemaChangeError",
    "SerializationError",
    "SourceError",
    "StateError",
    "StateFormatError",
    "StateUnavailableError",
]


class DbFanoutError(Exception):
    """Base class of every error dbfanout raises on purpose."""

    retryable: bool = False
    hint: str = ""
    window: str | None = None

    def __init__(self, message: str, *, hint: str | None = None, window: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint
        if window is not None:
            self.window = window

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text} (hint: {self.hint})" if self.hint else text


class ConfigError(DbFanoutError):
    """Raised when dbfanout.toml or an app setting is missing or invalid; names the key."""

    hint = "fix the named key in dbfanout.toml (or the named app setting) and restart"

    def __init__(self, key: str, problem: str, *, hint: str | None = None) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}", hint=hint)


class SourceError(DbFanoutError):
    """Raised for problems reading the source database."""

    hint = "check the source database and the poller's table/query settings"


class FetchError(SourceError):
    """Raised when the keyset query fails; the checkpoint is untouched and the next tick retries."""

    retryable = True
    hint = "the database is unreachable or the query failed; polling resumes once fetches succeed"


class CursorError(SourceError):
    """Raised when a cursor value cannot be ordered safely (naive datetime, NULL, unsupported type)."""

    hint = "use a monotonic, non-NULL cursor column; set cursor_timezone for naive timestamps"


class PositionLostError(SourceError):
    """Raised when the log a source reads no longer holds the changes after the checkpoint (a
    replication slot PostgreSQL invalidated or dropped, a purged binlog): an operator decision.

    It stays until someone acts, so the poller logs it once per state, not a traceback per tick
    (``poller.functions``); the message names what was lost and the one command that recovers.
    """

    hint = "run `dbfanout validate --fix`: it replaces the lost position and requests a snapshot (docs/operations.md)"


class SchemaChangeError(SourceError):
    """Raised when a migration renamed, dropped or retyped a column the checkpoint depends on.

    The cursor and key columns are what a checkpoint holds: which column takes their place, and
    whether the stored position still means the same thing, is the operator's decision. Other
    columns follow the table by themselves.
    """

    hint = "follow the runbook in docs/operations.md#schema-changes-migrations"


class SerializationError(DbFanoutError):
    """Raised when a value, state blob or message cannot be encoded or decoded."""

    hint = "the data has a type dbfanout cannot carry exactly; cast it in a query-mode poller"


class StateFormatError(SerializationError):
    """Raised when a state blob is corrupt or written by an unknown format version."""

    hint = "inspect it with `dbfanout checkpoint export`; restore the backup or reset the checkpoint"


class EnvelopeError(SerializationError):
    """Raised when a queue message is not a valid dbfanout batch; it must end in the DLQ."""

    hint = "the message was not produced by a dbfanout poller (or is corrupt); inspect it with `dbfanout dlq peek`"


class StateError(DbFanoutError):
    """Raised for problems with the state store."""

    hint = "check the state storage account, the container and the identity's RBAC role on it"


class StateUnavailableError(StateError):
    """Raised when the state store cannot be reached; a timed-out write may still have landed."""

    retryable = True


class FingerprintMismatchError(StateError):
    """Raised when the stored checkpoint belongs to a different source definition."""

    hint = (
        "the poller's source (url, table/query, cursor, pk or filter) changed since the checkpoint "
        "was written; run `dbfanout checkpoint reset POLLER --accept-fingerprint` (see the operations "
        "guide) or use a new poller name"
    )


class LeaseError(DbFanoutError):
    """Raised for lease protocol problems."""

    hint = "another instance owns the poller; keep lease_ttl_seconds above the slowest tick"


class LostLeaseError(LeaseError):
    """Raised when a heartbeat, commit or release finds the lease taken by a newer owner (W4)."""

    window = "W4"


class CommitError(DbFanoutError):
    """Raised when the checkpoint write failed; the batch stays unacknowledged and is re-sent (W1)."""

    retryable = True
    window = "W1"
    hint = "the batch will be re-enqueued on the next tick; duplicate detection absorbs it"


class CommitAmbiguousError(CommitError):
    """Raised when the checkpoint write timed out: it may or may not have landed (W5)."""

    window = "W5"
    hint = "the next tick reloads the state and resolves it; at worst the batch is delivered twice"


class EnqueueError(DbFanoutError):
    """Raised when the broker did not accept every message of a batch; the checkpoint stays put."""

    retryable = True
    hint = "check the Service Bus namespace, the queue name and the identity's Data Sender role"


#: Why a broker refuses sends for now (:class:`BrokerRefusingError`).
RefusalReason = Literal["queue_full", "throttled", "unreachable"]

_REFUSAL_HINTS: dict[str, str] = {
    "queue_full": "the queue (or topic) reached its maximum size: are the workers running? receive messages "
    "or raise MaxSizeInMegabytes; the poller backs off and resumes by itself, losing nothing",
    "throttled": "the namespace throttles requests (ServerBusy): the poller backs off and resumes by itself; "
    "if it lasts, move to a larger tier or more messaging units",
    "unreachable": "the broker cannot be reached (connection refused or reset, timeout): check the namespace "
    "(or storage account), DNS and the network; the poller backs off and resumes by itself",
}


class BrokerRefusingError(EnqueueError):
    """Raised when the broker refuses sends for a while (queue full, throttled, unreachable).

    A state rather than a failure: the poller backs off (:mod:`poller.tick.backoff`), keeps its
    checkpoint and resumes by itself; ``reason`` says which condition it is.
    """

    def __init__(self, message: str, reason: RefusalReason) -> None:
        self.reason: RefusalReason = reason
        super().__init__(message, hint=_REFUSAL_HINTS[reason])


class OversizeRowError(EnqueueError):
    """Raised when a single row is larger than the queue's maximum message size."""

    retryable = False
    hint = (
        "shrink the row with a query-mode poller, raise max_message_bytes (Premium), or set "
        'oversize_policy = "claim-check"'
    )


class HandlerError(DbFanoutError):
    """Raised when a user handler failed; the message is retried, split, then dead-lettered."""

    retryable = True
    hint = "fix the handler or the data; poison rows end in the dead-letter queue for replay"
