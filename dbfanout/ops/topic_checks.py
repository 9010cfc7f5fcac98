"""``dbfanout validate`` for a topic poller: the topic, its subscriptions and their rules.

Two sources, as for queues:

* the data plane (Listen/Send rights, works against the emulator too): the topic exists (a sender
  opens on it), each configured subscription exists (a peek), and whether it requires sessions
  (a non-session receiver is refused);
* the management API (the Manage right; Azure only, the emulator has none): the topic's duplicate
  detection, each subscription's MaxDeliveryCount and lock duration, its rules, and subscriptions
  on the topic that the config does not name. The decisions on what it reads are the pure
  :func:`topology_checks`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from azure.servicebus import ServiceBusClient

from dbfanout.ops.bus import Entity, is_emulator, probe_queue, probe_topic
from dbfanout.ops.checks import Check, duplicate_detection_check, duration_seconds, max_delivery_check, session_check
from shared.config import Config, PollerConfig
from shared.topology import RULE_NAME, subscription_rule

__all__ = ["SubscriptionFacts", "TopicFacts", "read_topic_facts", "rule_check", "topic_checks", "topology_checks"]


@dataclass(frozen=True, slots=True)
class SubscriptionFacts:
    """What the management API says about one subscription."""

    max_delivery_count: int
    lock_duration_seconds: float
    #: rule name → its SQL expression (None: a correlation filter, which dbfanout never creates)
    rules: Mapping[str, str | None]


@dataclass(frozen=True, slots=True)
class TopicFacts:
    """What the management API says about a topic and every subscription on it."""

    requires_duplicate_detection: bool
    duplicate_window_seconds: float
    max_message_bytes: int
    subscriptions: Mapping[str, SubscriptionFacts]


def read_topic_facts(connection_string: str, topic: str) -> TopicFacts:
    """Read the topic, its subscriptions and their rules (needs the Manage right)."""
    from azure.servicebus.management import ServiceBusAdministrationClient, SqlRuleFilter

    with ServiceBusAdministrationClient.from_connection_string(connection_string) as admin:
        props = admin.get_topic(topic)
        subs: dict[str, SubscriptionFacts] = {}
        for sub in admin.list_subscriptions(topic):
            rules = {
                r.name: r.filter.sql_expression if isinstance(r.filter, SqlRuleFilter) else None
                for r in admin.list_rules(topic, sub.name)
            }
            subs[sub.name] = SubscriptionFacts(sub.max_delivery_count or 0, duration_seconds(sub.lock_duration), rules)
    return TopicFacts(
        bool(props.requires_duplicate_detection),
        duration_seconds(props.duplicate_detection_history_time_window),
        (props.max_message_size_in_kilobytes or 256) * 1024,
        subs,
    )


def _same_sql(a: str, b: str) -> bool:
    return " ".join(a.split()) == " ".join(b.split())


def rule_check(cfg: PollerConfig, subscription: str, rules: Mapping[str, str | None]) -> Check:
    """The subscription's rules must be exactly ``$Default`` = :func:`shared.topology.subscription_rule`.

    Otherwise messages addressed to one subscription (``dbfanout-to``: split singles, DLQ replays)
    reach the wrong ones, or its own never arrive.
    """
    name = f"rule [{subscription}]"
    expected = subscription_rule(cfg.subscription(subscription))
    fix = (
        f"set the rule {RULE_NAME} of {cfg.queue}/{subscription} to the SQL filter {expected!r} and remove any "
        "other rule (deploy infra/ again, or `az servicebus topic subscription rule create/delete`)"
    )
    actual = rules.get(RULE_NAME, "")
    if RULE_NAME not in rules or actual is None or not _same_sql(actual, expected):
        shown = "missing" if RULE_NAME not in rules else repr(actual) if actual is not None else "a correlation filter"
        return Check(
            cfg.name,
            name,
            "fail",
            f"{RULE_NAME} is {shown}: split singles and DLQ replays meant for one subscription would reach the "
            f"wrong subscriptions, or miss this one; {fix}",
        )
    others = sorted(set(rules) - {RULE_NAME})
    if others:
        return Check(
            cfg.name,
            name,
            "fail",
            f"extra rule(s) {', '.join(others)}: a message matching any rule is delivered, so messages meant for "
            f"other subscriptions can reach this one; {fix}",
        )
    return Check(cfg.name, name, "ok", f"{RULE_NAME}: {expected}")


def topology_checks(cfg: PollerConfig, facts: TopicFacts) -> Iterator[Check]:
    """What the management API's view of the topic means for the poller (pure)."""
    p = cfg.name
    yield duplicate_detection_check(cfg, facts.requires_duplicate_detection, facts.duplicate_window_seconds)
    if cfg.max_message_bytes > facts.max_message_bytes:
        yield Check(
            p,
            "message size",
            "fail",
            f"max_message_bytes {cfg.max_message_bytes} > the topic's {facts.max_message_bytes}",
        )
    for name in sorted(cfg.subscriptions):
        sub = facts.subscriptions.get(name)
        if sub is None:
            continue  # reported by the data-plane probe ("subscription [name]")
        yield max_delivery_check(cfg, sub.max_delivery_count, name)
        yield Check(
            p,
            f"lock duration [{name}]",
            "ok" if sub.lock_duration_seconds >= 30 else "warn",
            f"{sub.lock_duration_seconds:.0f}s: handlers must finish well within it "
            "(the Functions host renews locks up to maxAutoLockRenewalDuration)",
        )
        yield rule_check(cfg, name, sub.rules)
    for extra in sorted(set(facts.subscriptions) - set(cfg.subscriptions)):
        yield Check(
            p,
            f"subscription [{extra}]",
            "warn",
            f"{cfg.queue}/{extra} is not in the config: it receives a copy of every batch, and no handler of this "
            f"app reads it (add [pollers.{p}.subscriptions.{extra}], or delete the subscription)",
        )


def topic_checks(config: Config, cfg: PollerConfig, client: ServiceBusClient) -> Iterator[Check]:
    """The topic and its subscriptions: probes first, then the management API where there is one."""
    p, topic = cfg.name, cfg.queue
    probe = probe_topic(client, topic)
    if probe.exists is False:
        yield Check(p, "topic", "fail", f"topic {topic} does not exist (deploy infra/, or add it to Config.json)")
        return
    if probe.exists is None:
        yield Check(p, "topic", "fail", f"{topic}: cannot check ({probe.error})")
        return
    yield Check(p, "topic", "ok", f"{topic} exists")
    for name in sorted(cfg.subscriptions):
        sub = probe_queue(client, Entity(topic, name))
        label = f"subscription [{name}]"
        if sub.exists:
            kind = " (session-enabled)" if sub.requires_session else ""
            yield Check(p, label, "ok", f"{topic}/{name} exists{kind}")
            yield session_check(cfg, sub, name)
        elif sub.exists is False:
            yield Check(
                p,
                label,
                "fail",
                f"{topic}/{name} does not exist: its handler never runs and the batches are not kept for it; "
                f"create it with the rule {RULE_NAME} = {subscription_rule(cfg.subscription(name))!r} "
                "(deploy infra/ again)",
            )
        else:
            yield Check(p, label, "fail", f"{topic}/{name}: cannot check ({sub.error})")
    yield from _management_checks(config, cfg)


def _management_checks(config: Config, cfg: PollerConfig) -> Iterator[Check]:
    p = cfg.name
    if is_emulator(config):
        yield Check(
            p,
            "topic properties",
            "skip",
            "not checkable against the emulator (no management API): on Azure validate also checks duplicate "
            "detection, each subscription's MaxDeliveryCount and rules, and subscriptions the config does not name",
        )
        return
    try:
        facts = read_topic_facts(config.settings.get(config.app.servicebus_connection) or "", cfg.queue)
    except Exception as exc:
        detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        yield Check(p, "topic properties", "skip", f"could not read them ({detail}); needs the Manage right")
        return
    yield from topology_checks(cfg, facts)
