"""Errors of the emulator.

EmulatorError
├── ConfigError              bad Config.json / queue properties (names the key)
└── BrokerError              a refused broker operation; ``condition`` is the AMQP error sent
    ├── EntityNotFoundError          amqp:not-found
    ├── MessageSizeExceededError     amqp:link:message-size-exceeded
    ├── QuotaExceededError           amqp:resource-limit-exceeded
    ├── ServerBusyError              com.microsoft:server-busy (fault injection)
    ├── MessageLockLostError         com.microsoft:message-lock-lost
    ├── SessionLockLostError         com.microsoft:session-lock-lost
    ├── SessionCannotBeLockedError   com.microsoft:session-cannot-be-locked
    ├── MessageNotFoundError         com.microsoft:message-not-found
    └── InvalidOperationError        amqp:not-allowed
"""

from __future__ import annotations

import datetime as dt
import uuid

#: What Service Bus says when it throttles (ServerBusy, error code 50009); the SDK raises
#: ``ServiceBusServerBusyError`` with it.
SERVER_BUSY_TEXT = (
    "The request was terminated because the entity is being throttled. Error code : 50009. "
    "Please wait 2 seconds and try again."
)


class EmulatorError(Exception):
    """Base of every emulator error."""


class ConfigError(EmulatorError):
    """The configuration is invalid; the message names the key to fix."""


class BrokerError(EmulatorError):
    """A broker operation was refused; sent to the client as ``condition``.

    A subclass names its AMQP condition and HTTP status as class keywords:
    ``class X(BrokerError, condition="amqp:not-found", status_code=404)``.
    """

    condition = "amqp:internal-error"
    status_code = 500

    def __init_subclass__(cls, *, condition: str | None = None, status_code: int | None = None) -> None:
        super().__init_subclass__()
        if condition is not None:
            cls.condition = condition
        if status_code is not None:
            cls.status_code = status_code


class EntityNotFoundError(BrokerError, condition="amqp:not-found", status_code=404):
    """The queue does not exist: add it to Config.json or call ``Emulator.create_queue``."""


class MessageSizeExceededError(BrokerError, condition="amqp:link:message-size-exceeded", status_code=413):
    """The message exceeds the queue's max message size (MaxMessageSizeInKilobytes)."""


class QuotaExceededError(BrokerError, condition="amqp:resource-limit-exceeded", status_code=403):
    """The queue holds MaxSizeInMegabytes already: receive messages or raise the limit.

    :func:`quota_exceeded_text` words it as Service Bus does (QuotaExceededException).
    """


def quota_exceeded_text(entity: str, size: int, limit: int) -> str:
    """Service Bus's description of a full entity: ``entity`` is a queue or a subscription
    (``topic/Subscriptions/name``: a topic's quota is the topic's)."""
    topic, sep, _ = entity.partition("/Subscriptions/")
    kind, name = ("Topic", topic) if sep else ("Queue", entity)
    return (
        f"The maximum entity size has been reached or exceeded for {kind}: '{name}'. "
        f"Size of entity in bytes:{size}, Max entity size in bytes: {limit}. "
        "For more information please see https://aka.ms/ServiceBusExceptions . "
        f"TrackingId:{uuid.uuid4()}, SystemTracker:{name}, "
        f"Timestamp:{dt.datetime.now(dt.UTC):%m/%d/%Y %I:%M:%S %p}"
    )


class ServerBusyError(BrokerError, condition="com.microsoft:server-busy", status_code=503):
    """Injected by ``Emulator.faults`` (with :data:`SERVER_BUSY_TEXT`); the SDK retries it."""


class MessageLockLostError(BrokerError, condition="com.microsoft:message-lock-lost", status_code=410):
    """The lock token is unknown or its lock expired; the message was or will be redelivered."""


class SessionLockLostError(BrokerError, condition="com.microsoft:session-lock-lost", status_code=410):
    """The session lock expired or belongs to another receiver."""


class SessionCannotBeLockedError(BrokerError, condition="com.microsoft:session-cannot-be-locked", status_code=410):
    """The session is locked by another receiver."""


class MessageNotFoundError(BrokerError, condition="com.microsoft:message-not-found", status_code=404):
    """No message with that sequence number (or not deferred)."""


class InvalidOperationError(BrokerError, condition="amqp:not-allowed", status_code=400):
    """The operation does not apply to this entity (e.g. dead-lettering in a dead-letter queue)."""
