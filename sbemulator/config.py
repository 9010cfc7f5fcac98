"""Configuration in the official Service Bus emulator's ``Config.json`` format.

The file is JSON with ``//`` comments::

    {"UserConfig": {"Namespaces": [{"Name": "sbemulatorns",
        "Queues": [{"Name": "q1", "Properties": {"LockDuration": "PT1M", ...}}]}],
     "Logging": {"Type": "Console"}}}

Durations are ISO-8601 (``PT1M``, ``P1DT2H``) or .NET ``hh:mm:ss``. Properties that are left
out take the official defaults (see :class:`QueueProperties`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from sbemulator.errors import ConfigError
from sbemulator.filters import Rule

DEFAULT_MAX_MESSAGE_SIZE = 256 * 1024
DEFAULT_MAX_QUEUE_BYTES = 64 * 1024 * 1024

_ISO = re.compile(
    r"^P(?:(?P<d>\d+(?:\.\d+)?)D)?(?:T(?:(?P<h>\d+(?:\.\d+)?)H)?(?:(?P<m>\d+(?:\.\d+)?)M)?"
    r"(?:(?P<s>\d+(?:\.\d+)?)S)?)?$"
)
_TIMESPAN = re.compile(r"^(?:(?P<d>\d+)\.)?(?P<h>\d+):(?P<m>\d+):(?P<s>\d+(?:\.\d+)?)$")
DurationLike = float | int | str | timedelta


def parse_duration(value: DurationLike, *, key: str = "duration") -> float:
    """Seconds from an ISO-8601 duration, a .NET TimeSpan string, a timedelta or a number."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, int | float):
        return float(value)
    text = value.strip().upper()
    m = _ISO.match(text) or _TIMESPAN.match(text)
    if not m or text in ("P", "PT"):
        raise ConfigError(f"{key}: {value!r} is not a duration; write ISO-8601 like 'PT30S' or 'PT1M'")
    parts = {k: float(v) for k, v in m.groupdict().items() if v}
    return parts.get("d", 0) * 86400 + parts.get("h", 0) * 3600 + parts.get("m", 0) * 60 + parts.get("s", 0)


@dataclass(frozen=True, slots=True)
class QueueProperties:
    """One queue's settings; defaults follow the official emulator/Service Bus defaults.

    Durations are seconds. ``max_message_size`` > 256 KB mimics the Premium tier;
    ``max_size_bytes`` bounds the memory a queue may hold (quota errors beyond it).
    """

    lock_duration: float = 60.0
    max_delivery_count: int = 10
    requires_duplicate_detection: bool = False
    duplicate_detection_history_time_window: float = 600.0
    default_message_time_to_live: float = 3600.0
    dead_lettering_on_message_expiration: bool = False
    requires_session: bool = False
    forward_to: str = ""
    forward_dead_lettered_messages_to: str = ""
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    max_size_bytes: int = DEFAULT_MAX_QUEUE_BYTES

    @classmethod
    def of(cls, **props: Any) -> QueueProperties:
        """Build from snake_case keywords; durations may be seconds, timedeltas or ISO strings."""
        return cls().with_changes(**props)

    def with_changes(self, **props: Any) -> QueueProperties:
        """A copy with some properties changed (same keyword rules as :meth:`of`)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = set(props) - names
        if unknown:
            raise ConfigError(f"unknown queue properties {sorted(unknown)}; known: {sorted(names)}")
        fixed: dict[str, Any] = {}
        for key, value in props.items():
            if key in _DURATIONS:
                fixed[key] = parse_duration(value, key=key)
            else:
                fixed[key] = value
        result = dataclasses.replace(self, **fixed)
        result.validate()
        return result

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the property that is out of range."""
        if self.lock_duration <= 0 or self.lock_duration > 300:
            raise ConfigError("LockDuration must be between PT1S and PT5M")
        if self.max_delivery_count < 1:
            raise ConfigError("MaxDeliveryCount must be at least 1")
        if self.default_message_time_to_live <= 0:
            raise ConfigError("DefaultMessageTimeToLive must be positive")
        if self.max_message_size < 1024 or self.max_size_bytes < self.max_message_size:
            raise ConfigError("MaxMessageSizeInKilobytes must be >= 1 and below MaxSizeInMegabytes")

    @classmethod
    def from_json(
        cls, raw: Mapping[str, Any], *, where: str = "Properties", allowed: frozenset[str] | None = None
    ) -> QueueProperties:
        """Parse the ``Properties`` object of a queue (or, with ``allowed``, a topic/subscription)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where} must be an object")
        known = allowed if allowed is not None else frozenset(_JSON_KEYS)
        kwargs: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in known:
                raise ConfigError(f"{where}.{key} is not a supported property here; known: {sorted(known)}")
            attr, convert = _JSON_KEYS[key]
            if value is None or value == "":
                continue
            kwargs[attr] = convert(value)
        return cls.of(**kwargs)


_DURATIONS = {"lock_duration", "duplicate_detection_history_time_window", "default_message_time_to_live"}
_JSON_KEYS: dict[str, tuple[str, Any]] = {
    "LockDuration": ("lock_duration", str),
    "MaxDeliveryCount": ("max_delivery_count", int),
    "RequiresDuplicateDetection": ("requires_duplicate_detection", bool),
    "DuplicateDetectionHistoryTimeWindow": ("duplicate_detection_history_time_window", str),
    "DefaultMessageTimeToLive": ("default_message_time_to_live", str),
    "DeadLetteringOnMessageExpiration": ("dead_lettering_on_message_expiration", bool),
    "RequiresSession": ("requires_session", bool),
    "ForwardTo": ("forward_to", str),
    "ForwardDeadLetteredMessagesTo": ("forward_dead_lettered_messages_to", str),
    "MaxMessageSizeInKilobytes": ("max_message_size", lambda kb: int(kb) * 1024),
    "MaxSizeInMegabytes": ("max_size_bytes", lambda mb: int(mb) * 1024 * 1024),
}


_SIZE_KEYS = {"MaxMessageSizeInKilobytes", "MaxSizeInMegabytes"}
TOPIC_KEYS = frozenset(
    {"DefaultMessageTimeToLive", "DuplicateDetectionHistoryTimeWindow", "RequiresDuplicateDetection", *_SIZE_KEYS}
)
SUBSCRIPTION_KEYS = frozenset(
    {
        "DeadLetteringOnMessageExpiration",
        "DefaultMessageTimeToLive",
        "LockDuration",
        "MaxDeliveryCount",
        "ForwardDeadLetteredMessagesTo",
        "ForwardTo",
        "RequiresSession",
    }
)


@dataclass(frozen=True, slots=True)
class SubscriptionConfig:
    """A topic subscription: its queue properties and its rules (none: every message matches)."""

    name: str
    properties: QueueProperties = field(default_factory=QueueProperties)
    rules: tuple[Rule, ...] = ()


@dataclass(frozen=True, slots=True)
class TopicConfig:
    """A topic: send-side properties (TTL, duplicate detection, sizes) and its subscriptions.

    ``raw`` keeps the Config.json object it came from (persistence stores topics that way).
    """

    name: str
    properties: QueueProperties = field(default_factory=QueueProperties)
    subscriptions: tuple[SubscriptionConfig, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], *, where: str = "Topics[0]") -> TopicConfig:
        """Parse one entry of ``Topics`` in Config.json."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where} must be an object with Name, Properties and Subscriptions")
        _no_unknown_keys(raw, {"Name", "Properties", "Subscriptions"}, where)
        name = raw.get("Name")
        if not name:
            raise ConfigError(f"{where}.Name is missing")
        props = QueueProperties.from_json(raw.get("Properties") or {}, where=f"{where}.Properties", allowed=TOPIC_KEYS)
        subs = []
        for i, sub in enumerate(raw.get("Subscriptions") or []):
            at = f"{where}.Subscriptions[{i}]"
            if not isinstance(sub, Mapping):
                raise ConfigError(f"{at} must be an object with Name, Properties and Rules")
            _no_unknown_keys(sub, {"Name", "Properties", "Rules"}, at)
            if not sub.get("Name"):
                raise ConfigError(f"{at}.Name is missing")
            own = QueueProperties.from_json(
                sub.get("Properties") or {}, where=f"{at}.Properties", allowed=SUBSCRIPTION_KEYS
            )
            # A subscription inherits the topic's size limits, and its TTL is capped by the topic's.
            sub_props = own.with_changes(
                default_message_time_to_live=min(own.default_message_time_to_live, props.default_message_time_to_live),
                max_message_size=props.max_message_size,
                max_size_bytes=props.max_size_bytes,
            )
            rules = tuple(Rule.from_json(r, f"{at}.Rules[{j}]") for j, r in enumerate(sub.get("Rules") or []))
            subs.append(SubscriptionConfig(str(sub["Name"]), sub_props, rules))
        names = [s.name.lower() for s in subs]
        if len(set(names)) != len(names):
            raise ConfigError(f"{where}: subscription names must be unique (case-insensitive)")
        return cls(str(name), props, tuple(subs), raw)


def _no_unknown_keys(raw: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}")


def subscription_path(topic: str, subscription: str) -> str:
    """The entity path of a subscription, as the SDK addresses it."""
    return f"{topic}/Subscriptions/{subscription}"


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """A queue name with its properties."""

    name: str
    properties: QueueProperties = field(default_factory=QueueProperties)


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """The namespace the emulator serves: its queues and topics."""

    namespace: str = "sbemulatorns"
    queues: tuple[QueueConfig, ...] = ()
    topics: tuple[TopicConfig, ...] = ()

    @classmethod
    def from_file(cls, path: str | Path) -> EmulatorConfig:
        """Read an official-format ``Config.json``."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}; pass an existing --config") from exc
        return cls.from_json_text(text)

    @classmethod
    def from_json_text(cls, text: str) -> EmulatorConfig:
        """Parse official-format Config.json text (``//`` and ``/* */`` comments allowed)."""
        try:
            doc = json.loads(_strip_comments(text))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"Config.json is not valid JSON at line {exc.lineno}: {exc.msg}") from exc
        namespaces = (doc.get("UserConfig") or {}).get("Namespaces") or []
        if not isinstance(namespaces, list) or len(namespaces) > 1:
            raise ConfigError("UserConfig.Namespaces must list exactly one namespace (as the official emulator)")
        if not namespaces:
            return cls()
        ns = namespaces[0]
        # Never ignore configuration silently: a key we do not emulate is an error naming it.
        _no_unknown_keys(ns, {"Name", "Queues", "Topics"}, "UserConfig.Namespaces[0]")
        queues = []
        for i, q in enumerate(ns.get("Queues") or []):
            _no_unknown_keys(q, {"Name", "Properties"}, f"Queues[{i}]")
            name = q.get("Name")
            if not name:
                raise ConfigError(f"UserConfig.Namespaces[0].Queues[{i}].Name is missing")
            props = QueueProperties.from_json(q.get("Properties") or {}, where=f"Queues[{i}].Properties")
            queues.append(QueueConfig(name, props))
        topics = tuple(TopicConfig.from_json(t, where=f"Topics[{i}]") for i, t in enumerate(ns.get("Topics") or []))
        config = cls(namespace=ns.get("Name") or "sbemulatorns", queues=tuple(queues), topics=topics)
        config.validate()
        return config

    @classmethod
    def with_queues(cls, *names: str, **queue_props: Any) -> EmulatorConfig:
        """Convenience for tests: the given queues, all with the same properties."""
        props = QueueProperties.of(**queue_props)
        return cls(queues=tuple(QueueConfig(n, props) for n in names))

    def validate(self) -> None:
        """Raise :class:`ConfigError` on duplicate names or forwarding to unknown entities."""
        names = [q.name.lower() for q in self.queues] + [t.name.lower() for t in self.topics]
        if len(set(names)) != len(names):
            raise ConfigError("queue and topic names must be unique (case-insensitive)")
        forwarders = [(f"queue {q.name!r}", q.properties) for q in self.queues]
        forwarders += [
            (f"subscription {subscription_path(t.name, s.name)!r}", s.properties)
            for t in self.topics
            for s in t.subscriptions
        ]
        for who, props in forwarders:
            if props.forward_to and props.forward_to.lower() not in names:
                raise ConfigError(f"{who} forwards to {props.forward_to!r}, which is not configured")
            target = props.forward_dead_lettered_messages_to
            if target and target.lower() not in names:
                raise ConfigError(f"{who} forwards dead letters to {target!r}, which is not configured")


def _strip_comments(text: str) -> str:
    """Remove // and /* */ comments outside strings."""
    out: list[str] = []
    i, n, in_str = 0, len(text), False
    while i < n:
        c = text[i]
        if in_str:
            out.append(c)
            if c == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
            out.append(c)
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)
