"""Failure records: why a dead-lettered (or poison-queue) message failed, kept beside the claims.

On Azure the Python worker cannot dead-letter a message with a reason of its own under
``autoCompleteMessages`` (explicit settlement needs the beta ``azurefunctions-extensions-bindings-
servicebus`` package): raising abandons the message and Service Bus dead-letters it after
MaxDeliveryCount with the reason ``MaxDeliveryCountExceeded`` and nothing about the exception. A
storage queue's poison copy carries nothing either. So the worker writes a small record to the
state container on each failed delivery, before it raises, and ``dbfanout dlq peek|export`` joins
it to the dead-lettered message:

- blob ``failures/<app>/<entity>/<key>.json``: ``entity`` the queue, or ``topic/subscription``;
  ``key`` the SHA-256 of the message body. The body travels unchanged to the dead-letter queue and
  to a storage queue's ``-poison`` copy (which gets a new message id), so both find their record.
- content: exception type and text (scrubbed, at most :data:`~shared.scrub.MAX_ERROR_CHARS`
  characters), delivery count, time, poller, subscription, message id, event ids.
- each failed delivery overwrites the record (it always holds the latest failure: the one that
  dead-lettered the message, once it is in the DLQ); a later successful delivery deletes it (best
  effort). The state account's lifecycle rule expires what remains.

Writing is best effort: a failure to write is logged and the delivery still fails as it would have.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from azure.core.exceptions import ResourceNotFoundError
from azure.storage.blob import ContainerClient

from shared.codec import dumps, loads
from shared.config import Config
from shared.errors import SerializationError

__all__ = ["FAILURE_PREFIX", "FailureRecord", "FailureStore", "body_key", "open_failure_store"]

#: Where failure records live in the state container (the infra lifecycle rule filters on it).
FAILURE_PREFIX = "failures"


def body_key(body: bytes) -> str:
    """The record's key: the body's SHA-256 (the body is what reaches the DLQ unchanged)."""
    return hashlib.sha256(body).hexdigest()


@dataclass(frozen=True, slots=True)
class FailureRecord:
    """The last failure of one message, as ``dlq peek --json`` shows it under ``failure``."""

    entity: str  # the queue, or topic/subscription
    poller: str
    message_id: str
    delivery_count: int
    failed_at: str  # ISO-8601, UTC
    error_type: str
    error: str  # scrubbed, bounded "Type: message"
    event_ids: tuple[str, ...] = ()
    subscription: str | None = None
    dead_lettered: bool = False  # the delivery was the last the configured MaxDeliveryCount allows

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["event_ids"] = list(self.event_ids)
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> FailureRecord:
        return cls(
            entity=str(doc.get("entity", "")),
            poller=str(doc.get("poller", "")),
            message_id=str(doc.get("message_id", "")),
            delivery_count=int(doc.get("delivery_count") or 0),
            failed_at=str(doc.get("failed_at", "")),
            error_type=str(doc.get("error_type", "")),
            error=str(doc.get("error", "")),
            event_ids=tuple(str(e) for e in doc.get("event_ids") or ()),
            subscription=doc.get("subscription"),
            dead_lettered=bool(doc.get("dead_lettered", False)),
        )


class FailureStore:
    """Failure records in one container under ``prefix`` (``failures/<app>``)."""

    def __init__(self, container: ContainerClient, prefix: str) -> None:
        self._container = container
        self._prefix = prefix

    def blob_name(self, entity: str, body: bytes) -> str:
        return f"{self._prefix}/{entity}/{body_key(body)}.json"

    def record(self, record: FailureRecord, body: bytes) -> None:
        """Write (overwrite) the record of the message with this body. Raises AzureError."""
        self._container.upload_blob(self.blob_name(record.entity, body), dumps(record.to_json()), overwrite=True)

    def clear(self, entity: str, body: bytes) -> None:
        """Delete the record (after a successful delivery); a missing one is fine."""
        try:
            self._container.delete_blob(self.blob_name(entity, body))
        except ResourceNotFoundError:
            return

    def lookup(self, entity: str, body: bytes) -> FailureRecord | None:
        """The record of the message with this body, or None (none written, expired, unreadable)."""
        try:
            raw = self._container.download_blob(self.blob_name(entity, body)).readall()
        except ResourceNotFoundError:
            return None
        try:
            doc = loads(raw)
        except SerializationError:
            return None
        return FailureRecord.from_json(doc) if isinstance(doc, dict) else None

    def close(self) -> None:
        self._container.close()


def open_failure_store(config: Config) -> FailureStore:
    """The app's failure records: the state container of the state storage account (no I/O yet)."""
    from shared.claimcheck import state_container

    return FailureStore(state_container(config), prefix=f"{FAILURE_PREFIX}/{config.app.name}")
