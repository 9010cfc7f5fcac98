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


class EmulatorError(Exception):
    """Base of every emulator error."""


class ConfigError(EmulatorError):
    """The configuration is invalid; the message names the key to fix."""


class BrokerError(EmulatorError):
    """A broker operation was refused; sent to the client as ``condition``."""

    condition = "amqp:internal-error"
    status_code = 500


class EntityNotFoundError(BrokerError):
    """The queue does not exist: add it to Config.json or call ``Emulator.create_queue``."""

    condition = "amqp:not-found"
    status_code = 404


class MessageSizeExceededError(BrokerError):
    """The message exceeds the queue's max message size (MaxMessageSizeInKilobytes)."""

    condition = "amqp:link:message-size-exceeded"
    status_code = 413


class QuotaExceededError(BrokerError):
    """The queue holds MaxSizeInMegabytes already: receive messages or raise the limit."""

    condition = "amqp:resource-limit-exceeded"
    status_code = 403


class ServerBusyError(BrokerError):
    """Injected by ``Emulator.faults``; the SDK retries it."""

    condition = "com.microsoft:server-busy"
    status_code = 503


class MessageLockLostError(BrokerError):
    """The lock token is unknown or its lock expired; the message was or will be redelivered."""

    condition = "com.microsoft:message-lock-lost"
    status_code = 410


class SessionLockLostError(BrokerError):
    """The session lock expired or belongs to another receiver."""

    condition = "com.microsoft:session-lock-lost"
    status_code = 410


class SessionCannotBeLockedError(BrokerError):
    """The session is locked by another receiver."""

    condition = "com.microsoft:session-cannot-be-locked"
    status_code = 410


class MessageNotFoundError(BrokerError):
    """No message with that sequence number (or not deferred)."""

    condition = "com.microsoft:message-not-found"
    status_code = 404


class InvalidOperationError(BrokerError):
    """The operation does not apply to this entity (e.g. dead-lettering in a dead-letter queue)."""

    condition = "amqp:not-allowed"
    status_code = 400
