"""Topic pollers in dbfanout.toml: ``topic`` + ``[pollers.X.subscriptions.NAME]``, and their rules."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest

from shared.config import parse_config
from shared.errors import ConfigError
from shared.topology import PROP_TARGET, entity_label, parse_entity, subscription_rule

TOPIC = """
[app]
name = "shop"

[pollers.orders]
source_url = "sqlite://"
table = "orders"
cursor = "updated_at"
pk = ["id"]
topic = "orders-changes"
cardinality = "many"

[pollers.orders.subscriptions.search]
handler = "handlers.search:handle"

[pollers.orders.subscriptions.audit]
handler = "handlers.audit:handle"
filter = "[dbfanout-event-count] > 0"
max_delivery_count = 4
cardinality = "one"
"""


def _data(text: str = TOPIC) -> dict[str, Any]:
    return tomllib.loads(text)


def test_topic_poller_loads_its_subscriptions() -> None:
    cfg = parse_config(_data(), {})
    orders = cfg.poller("orders")
    assert orders.is_topic and orders.topic == "orders-changes" and orders.queue == "orders-changes"
    assert list(orders.subscriptions) == ["search", "audit"]
    search, audit = orders.subscription("search"), orders.subscription("audit")
    assert (search.handler, search.filter, search.cardinality) == ("handlers.search:handle", None, "many")
    assert (audit.filter, audit.max_delivery_count, audit.cardinality) == ("[dbfanout-event-count] > 0", 4, "one")
    assert orders.deliveries_for("audit") == 4 and orders.deliveries_for("search") == 10
    assert cfg.queues() == {} and cfg.topics() == {"orders-changes": orders}


def test_queue_pollers_are_unchanged() -> None:
    data = _data()
    poller = data["pollers"]["orders"]
    del poller["topic"], poller["subscriptions"]
    poller.update(queue="orders-q", handler="handlers.orders:handle")
    orders = parse_config(data, {}).poller("orders")
    assert not orders.is_topic and orders.subscriptions == {} and orders.deliveries_for(None) == 10


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (lambda p: p.update(queue="q"), "pollers.orders.topic"),
        (lambda p: p.update(handler="handlers.x:handle"), "pollers.orders.handler"),
        (lambda p: p.update(subscriptions={}), "pollers.orders.subscriptions"),
        (lambda p: p.update(transport="storage-queue"), "pollers.orders.transport"),
        (lambda p: p["subscriptions"]["search"].pop("handler"), "pollers.orders.subscriptions.search.handler"),
        (lambda p: p["subscriptions"]["search"].update(handle="x:y"), "pollers.orders.subscriptions.search.handle"),
        (lambda p: p["subscriptions"].update({"a b": {"handler": "a:b"}}), "pollers.orders.subscriptions.a b"),
        (lambda p: p["subscriptions"].update({"-x": {"handler": "a:b"}}), "pollers.orders.subscriptions.-x"),
    ],
)
def test_topic_mistakes_name_their_key(change: Any, key: str) -> None:
    data = _data()
    change(data["pollers"]["orders"])
    with pytest.raises(ConfigError) as info:
        parse_config(data, {})
    assert info.value.key == key


def test_subscriptions_without_a_topic_are_refused() -> None:
    data = _data()
    poller = data["pollers"]["orders"]
    del poller["topic"]
    poller["queue"] = "q"
    with pytest.raises(ConfigError) as info:
        parse_config(data, {})
    assert info.value.key == "pollers.orders.subscriptions"


def test_a_topic_has_one_poller_and_is_no_queue() -> None:
    data = _data()
    data["pollers"]["refunds"] = {**data["pollers"]["orders"], "table": "refunds"}
    with pytest.raises(ConfigError, match="already the topic of poller orders"):
        parse_config(data, {})
    data["pollers"]["refunds"] = {k: v for k, v in data["pollers"]["orders"].items() if k != "subscriptions"}
    del data["pollers"]["refunds"]["topic"]
    data["pollers"]["refunds"].update(queue="orders-changes", handler="a:b")
    with pytest.raises(ConfigError, match="also a poller's queue"):
        parse_config(data, {})


def test_subscription_rules_let_through_untargeted_and_own_targeted_messages() -> None:
    orders = parse_config(_data(), {}).poller("orders")
    assert subscription_rule(orders.subscription("search")) == (
        f"[{PROP_TARGET}] IS NULL OR [{PROP_TARGET}] = 'search'"
    )
    assert subscription_rule(orders.subscription("audit")) == (
        f"([{PROP_TARGET}] IS NULL AND ([dbfanout-event-count] > 0)) OR [{PROP_TARGET}] = 'audit'"
    )


def test_subscription_rules_select_messages_in_the_emulator_filter_engine() -> None:
    """The rule text is Service Bus SQL: the emulator's filter engine evaluates it as the service would."""
    from sbemulator.filters import MessageView, SqlFilter

    def view(**user: object) -> MessageView:
        return MessageView({}, {k.lower(): v for k, v in user.items()})

    orders = parse_config(_data(), {}).poller("orders")
    search = SqlFilter.compile(subscription_rule(orders.subscription("search")))
    audit = SqlFilter.compile(subscription_rule(orders.subscription("audit")))
    plain = view(**{"dbfanout-event-count": 3})
    for_audit = view(**{"dbfanout-event-count": 1, PROP_TARGET: "audit"})
    assert search(plain) and audit(plain)
    assert not search(for_audit) and audit(for_audit)
    assert not audit(view(**{"dbfanout-event-count": 0}))


def test_entity_names() -> None:
    orders = parse_config(_data(), {}).poller("orders")
    assert entity_label(orders, "search") == "orders-changes/search"
    assert parse_entity("orders-changes/search") == ("orders-changes", "search")
    assert parse_entity("orders-changes/Subscriptions/search") == ("orders-changes", "search")
    assert parse_entity("orders-changes") == ("orders-changes", None)
