"""The Service Bus entities an app needs, declared for the local emulator.

Each Service Bus poller's queue, with duplicate detection (the poller's message id is its
idempotency key) and the poller's MaxDeliveryCount; each topic poller's topic, with duplicate
detection, and one subscription per configured subscription: its MaxDeliveryCount, sessions when
the poller orders by key, and its ``$Default`` rule, :func:`shared.topology.subscription_rule`
(the same rule ``infra/`` creates on Azure). Storage-queue pollers need no Service Bus entity.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from sbemulator.config import SUBSCRIPTION_KEYS, TOPIC_KEYS, EmulatorConfig, QueueConfig, QueueProperties, TopicConfig
from sbemulator.errors import ConfigError as EmulatorConfigError
from shared.config import Config, PollerConfig, load_config
from shared.errors import DbFanoutError
from shared.topology import RULE_NAME, subscription_rule

__all__ = ["emulator_config_for", "emulator_entities"]


def emulator_config_for(config: Config, **queue_props: Any) -> EmulatorConfig:
    """The app's queues and topics; ``queue_props`` (:meth:`QueueProperties.of` keywords, e.g.
    ``lock_duration="PT30S"``) apply to every queue and subscription (and topic, where they fit)."""
    base = QueueProperties.of(**queue_props)
    queues = tuple(
        QueueConfig(name, _queue_properties(base, pollers))
        for name, pollers in config.queues().items()
        if all(p.transport == "servicebus" for p in pollers)
    )
    topics = tuple(_topic(base, poller) for poller in config.topics().values())
    result = EmulatorConfig(queues=queues, topics=topics)
    result.validate()
    return result


def _queue_properties(base: QueueProperties, pollers: list[PollerConfig]) -> QueueProperties:
    return base.with_changes(
        requires_duplicate_detection=True,
        max_delivery_count=max(p.deliveries for p in pollers),
        requires_session=any(p.sessions for p in pollers),
    )


def _topic(base: QueueProperties, poller: PollerConfig) -> TopicConfig:
    """The topic as a Config.json object (the emulator persists topics in that form)."""
    subscriptions = [
        {
            "Name": sub.name,
            "Properties": _json_properties(
                base.with_changes(max_delivery_count=poller.deliveries_for(sub.name), requires_session=poller.sessions),
                SUBSCRIPTION_KEYS,
            ),
            "Rules": [_sql_rule(RULE_NAME, subscription_rule(sub))],
        }
        for sub in poller.subscriptions.values()
    ]
    topic_props = _json_properties(base.with_changes(requires_duplicate_detection=True), TOPIC_KEYS)
    return TopicConfig.from_json(
        {"Name": poller.queue, "Properties": topic_props, "Subscriptions": subscriptions},
        where=f"pollers.{poller.name}.topic",
    )


def _sql_rule(name: str, expression: str) -> dict[str, Any]:
    return {"Name": name, "Properties": {"FilterType": "Sql", "SqlFilter": {"SqlExpression": expression}}}


def _iso(seconds: float) -> str:
    return f"PT{seconds:g}S"


# QueueProperties field -> (Config.json key, how the value is written there)
_JSON: dict[str, tuple[str, Any]] = {
    "lock_duration": ("LockDuration", _iso),
    "max_delivery_count": ("MaxDeliveryCount", int),
    "requires_duplicate_detection": ("RequiresDuplicateDetection", bool),
    "duplicate_detection_history_time_window": ("DuplicateDetectionHistoryTimeWindow", _iso),
    "default_message_time_to_live": ("DefaultMessageTimeToLive", _iso),
    "dead_lettering_on_message_expiration": ("DeadLetteringOnMessageExpiration", bool),
    "requires_session": ("RequiresSession", bool),
    "forward_to": ("ForwardTo", str),
    "forward_dead_lettered_messages_to": ("ForwardDeadLetteredMessagesTo", str),
    "max_message_size": ("MaxMessageSizeInKilobytes", lambda b: b // 1024),
    "max_size_bytes": ("MaxSizeInMegabytes", lambda b: b // (1024 * 1024)),
}


def _json_properties(props: QueueProperties, allowed: frozenset[str]) -> dict[str, Any]:
    """The Config.json ``Properties`` of ``props`` that an entity of this kind accepts."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(props):
        key, render = _JSON.get(f.name, ("", None))
        value = getattr(props, f.name)
        if key in allowed and value != "":  # "" (no forwarding) is left out, as Config.json does
            out[key] = render(value)
    return out


def emulator_entities(app_config: Path) -> EmulatorConfig:
    """``dbfanout emulator servicebus --app-config F``: the entities the app of ``F`` needs.

    Settings resolve leniently (a ``${NAME}`` that is not set does not matter to the emulator);
    a bad file is reported as the emulator's own configuration error.
    """
    from shared.settings import load_settings

    try:
        config = load_config(app_config, settings=load_settings(app_config.resolve().parent), lenient_settings=True)
        return emulator_config_for(config)
    except DbFanoutError as exc:
        raise EmulatorConfigError(f"--app-config {app_config}: {exc}") from exc
