"""Topic fan-out topology: how a message reaches every subscription, or just one (pure).

A topic poller sends each batch once to its topic; every subscription gets a copy and handles,
retries, splits and dead-letters it on its own. A message meant for one subscription only — the
singles of a split, a DLQ replay — carries the application property ``dbfanout-to`` naming it, and
each subscription's rule (:func:`subscription_rule`) lets through the untargeted messages its
filter accepts plus the messages targeted at it. The same rule is created by ``infra/`` (Bicep),
by the local emulator config and checked by ``dbfanout validate``.
"""

from __future__ import annotations

from shared.config import PollerConfig, SubscriptionConfig

__all__ = [
    "PROP_TARGET",
    "RULE_NAME",
    "entity_label",
    "parse_entity",
    "subscription_rule",
]

#: Application property naming the one subscription a message is for (absent: every subscription).
PROP_TARGET = "dbfanout-to"
#: The rule every subscription is created with (it replaces the default match-all rule).
RULE_NAME = "$Default"


def subscription_rule(subscription: SubscriptionConfig) -> str:
    """The SQL filter of a subscription's ``$Default`` rule.

    ``[dbfanout-to] IS NULL OR [dbfanout-to] = 'search'`` without a user filter;
    ``([dbfanout-to] IS NULL AND (<filter>)) OR [dbfanout-to] = 'search'`` with one (a targeted
    message already passed the filter once, so a replay is not filtered again).
    """
    target = f"[{PROP_TARGET}] = '{subscription.name}'"  # names cannot hold quotes (config checks)
    untargeted = f"[{PROP_TARGET}] IS NULL"
    if subscription.filter:
        return f"({untargeted} AND ({subscription.filter})) OR {target}"
    return f"{untargeted} OR {target}"


def entity_label(poller: PollerConfig, subscription: str | None = None) -> str:
    """``queue`` or ``topic/subscription``: how the CLI names where a poller's messages wait."""
    return f"{poller.queue}/{subscription}" if subscription is not None else poller.queue


def parse_entity(name: str) -> tuple[str, str | None]:
    """``"orders/search"`` → ``("orders", "search")``; ``"orders"`` → ``("orders", None)``.

    Accepts the Service Bus path form ``orders/subscriptions/search`` too.
    """
    parts = name.strip("/").split("/")
    if len(parts) == 3 and parts[1].lower() == "subscriptions":
        return parts[0], parts[2]
    if len(parts) == 2:
        return parts[0], parts[1]
    return name, None
