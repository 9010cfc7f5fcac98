"""The parts of ``host.json`` the local host honours, with the Functions host's defaults.

Service Bus extension 5.x (``extensions.serviceBus``): ``autoCompleteMessages`` true,
``maxAutoLockRenewalDuration`` 00:05:00, ``maxConcurrentCalls`` 16, ``maxConcurrentSessions`` 8,
``prefetchCount`` 0, ``maxMessageBatchSize`` 1000, ``sessionIdleTimeout`` the try timeout
(00:01:00); ``clientRetryOptions.mode`` is checked against the values the published host.json
schema allows. Storage Queues extension 5.x (``extensions.queues``): ``batchSize`` 16,
``newBatchThreshold`` batchSize/2, ``maxPollingInterval`` 00:01:00, ``visibilityTimeout`` 00:00:00,
``maxDequeueCount`` 5, ``messageEncoding`` base64. ``logging.logLevel.default`` / ``Function`` set
the log level.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import ConfigError

__all__ = ["HostJson", "QueueOptions", "ServiceBusOptions", "load_host_json", "parse_timespan"]

_TIMESPAN = re.compile(r"^(?:(\d+)\.)?(\d{1,2}):(\d{2}):(\d{2})(?:\.(\d{1,7}))?$")
_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "information": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "none": logging.CRITICAL + 10,
}


def parse_timespan(value: str, key: str) -> float:
    """A .NET TimeSpan (``[d.]hh:mm:ss[.fffffff]``) in seconds."""
    match = _TIMESPAN.match(value.strip())
    if match is None:
        raise ConfigError(key, f"{value!r} is not a TimeSpan", hint='write "hh:mm:ss", e.g. "00:05:00"')
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups()[:4])
    fraction = float(f"0.{match.group(5)}") if match.group(5) else 0.0
    return days * 86400 + hours * 3600 + minutes * 60 + seconds + fraction


@dataclass(frozen=True, slots=True)
class ServiceBusOptions:
    """``extensions.serviceBus`` settings the local host applies (official defaults)."""

    auto_complete_messages: bool = True
    max_auto_lock_renewal_seconds: float = 300.0
    max_concurrent_calls: int = 16
    prefetch_count: int = 0
    max_message_batch_size: int = 1000
    max_concurrent_sessions: int = 8
    client_retry_mode: str = "exponential"
    # How long a session with no new message is held before the next one is accepted; the
    # extension's default is the client's try timeout (clientRetryOptions.tryTimeout, 00:01:00).
    session_idle_timeout_seconds: float = 60.0


@dataclass(frozen=True, slots=True)
class QueueOptions:
    """``extensions.queues`` settings the local host applies (official defaults)."""

    batch_size: int = 16
    new_batch_threshold: int = 8
    max_polling_interval_seconds: float = 60.0
    visibility_timeout_seconds: float = 0.0
    max_dequeue_count: int = 5
    message_encoding: str = "base64"

    @property
    def max_concurrent_calls(self) -> int:
        """The host fetches a new batch once in-flight calls drop to the threshold."""
        return self.batch_size + self.new_batch_threshold


@dataclass(frozen=True, slots=True)
class HostJson:
    service_bus: ServiceBusOptions = ServiceBusOptions()
    log_level: int = logging.INFO
    queues: QueueOptions = QueueOptions()


def _int(
    section: dict[str, Any], name: str, default: int, lo: int, ext: str = "serviceBus", hi: int | None = None
) -> int:
    value = section.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"from {lo} to {hi}"
        raise ConfigError(f"host.json extensions.{ext}.{name}", f"must be an integer {bound} (got {value!r})")
    return value


# SchemaStore's host.json schema (src/schemas/json/host.json, definitions.version-2-ext-5):
# extensions.serviceBus.clientRetryOptions.mode is an enum of these lower-case values.
_RETRY_MODES = ("exponential", "fixed")


def _retry_mode(section: dict[str, Any]) -> str:
    key = "host.json extensions.serviceBus.clientRetryOptions"
    retry = section.get("clientRetryOptions", {})
    if not isinstance(retry, dict):
        raise ConfigError(key, f"must be an object (got {retry!r})")
    mode = retry.get("mode", "exponential")
    if mode not in _RETRY_MODES:
        raise ConfigError(
            f"{key}.mode",
            f"must be one of {', '.join(_RETRY_MODES)} (got {mode!r})",
            hint="the host.json schema's values are lower-case",
        )
    return str(mode)


def _service_bus(section: dict[str, Any]) -> ServiceBusOptions:
    auto = section.get("autoCompleteMessages", True)
    if not isinstance(auto, bool):
        key = "host.json extensions.serviceBus.autoCompleteMessages"
        raise ConfigError(key, f"must be true or false (got {auto!r})")
    renewal = section.get("maxAutoLockRenewalDuration", "00:05:00")
    retry = section.get("clientRetryOptions") or {}
    try_timeout = retry.get("tryTimeout", "00:01:00") if isinstance(retry, dict) else "00:01:00"
    idle = section.get("sessionIdleTimeout", try_timeout)
    return ServiceBusOptions(
        auto_complete_messages=auto,
        max_auto_lock_renewal_seconds=parse_timespan(
            str(renewal), "host.json extensions.serviceBus.maxAutoLockRenewalDuration"
        ),
        max_concurrent_calls=_int(section, "maxConcurrentCalls", 16, 1),
        prefetch_count=_int(section, "prefetchCount", 0, 0),
        max_message_batch_size=_int(section, "maxMessageBatchSize", 1000, 1),
        max_concurrent_sessions=_int(section, "maxConcurrentSessions", 8, 1),
        client_retry_mode=_retry_mode(section),
        session_idle_timeout_seconds=parse_timespan(str(idle), "host.json extensions.serviceBus.sessionIdleTimeout"),
    )


def _queues(section: dict[str, Any]) -> QueueOptions:
    key = "host.json extensions.queues"
    # The service returns at most 32 messages per request, so that is batchSize's ceiling.
    batch = _int(section, "batchSize", 16, 1, "queues", hi=32)
    encoding = str(section.get("messageEncoding", "base64")).lower()
    if encoding != "base64":
        raise ConfigError(
            f"{key}.messageEncoding",
            f"the local host serves base64 only (got {encoding!r})",
            hint="dbfanout writes base64 text, which is the binding's default; remove the setting",
        )
    return QueueOptions(
        batch_size=batch,
        new_batch_threshold=_int(section, "newBatchThreshold", batch // 2, 0, "queues"),
        max_polling_interval_seconds=max(
            0.1, parse_timespan(str(section.get("maxPollingInterval", "00:01:00")), f"{key}.maxPollingInterval")
        ),
        visibility_timeout_seconds=parse_timespan(
            str(section.get("visibilityTimeout", "00:00:00")), f"{key}.visibilityTimeout"
        ),
        max_dequeue_count=_int(section, "maxDequeueCount", 5, 1, "queues"),
        message_encoding=encoding,
    )


def _log_level(doc: dict[str, Any]) -> int:
    levels = doc.get("logging", {}).get("logLevel", {})
    raw = levels.get("Function", levels.get("default", "Information"))
    return _LEVELS.get(str(raw).lower(), logging.INFO)


def load_host_json(app_root: Path) -> HostJson:
    """Read ``app_root/host.json``; a missing file gives the defaults, a broken one an error."""
    path = app_root / "host.json"
    if not path.is_file():
        return HostJson()
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(str(path), f"cannot read host.json: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(str(path), "host.json must hold a JSON object")
    extensions = doc.get("extensions", {})
    section = extensions.get("serviceBus", {})
    if not isinstance(section, dict):
        raise ConfigError("host.json extensions.serviceBus", "must be an object")
    queues = extensions.get("queues", {})
    if not isinstance(queues, dict):
        raise ConfigError("host.json extensions.queues", "must be an object")
    return HostJson(service_bus=_service_bus(section), log_level=_log_level(doc), queues=_queues(queues))
