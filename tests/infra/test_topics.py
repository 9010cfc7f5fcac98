"""infra/ for topic pollers: the topic, its subscriptions and their rules agree with the code and the config.

The subscription rule is written in Bicep (modules/servicebus-topic.bicep) and in Python
(shared/topology.py); these tests evaluate the Bicep string template and compare it with
``subscription_rule``. The consistency checks (infra/consistency.py) are each shown passing on the
repository's parameters and failing on a broken copy, like tests/infra/test_consistency.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from shared.config import SubscriptionConfig, parse_config
from shared.topology import PROP_TARGET, subscription_rule
from tests.infra.conftest import FIXTURE_CONFIG, INFRA, REPO_INFRA, replace_once
from tests.infra.test_consistency import checks_of, edit_parameters, write_config

TOPIC_MODULE = INFRA / "modules" / "servicebus-topic.bicep"
RBAC_TOPIC_MODULE = INFRA / "modules" / "rbac-topic.bicep"
SETTINGS = {"ORDERS_DB_URL": "sqlite://", "CUSTOMERS_DB_URL": "sqlite://"}


# ------------------------------------------------------------ the Bicep rule is the code's rule


def bicep_rule(module: Path, name: str, user_filter: str) -> str:
    """The sqlExpression the rule resource of ``module`` gives a subscription (``user_filter``: '' = none).

    Reads ``sqlExpression: empty(filters[i]) ? '<no filter>' : '<with filter>'`` and evaluates the
    chosen Bicep string: ``\\'`` is a quote, ``${s.name}`` the subscription, ``${filters[i]}`` the filter.
    """
    text = module.read_text(encoding="utf-8")
    m = re.search(r"sqlExpression:\s*empty\(filters\[i\]\)\s*\?\s*'((?:\\.|[^'\\])*)'\s*:\s*'((?:\\.|[^'\\])*)'", text)
    assert m, f"no `sqlExpression: empty(filters[i]) ? '...' : '...'` in {module}"
    template = m.group(1) if not user_filter else m.group(2)
    substitutions = {"s.name": name, "filters[i]": user_filter}

    def interpolate(match: re.Match[str]) -> str:
        expr = match.group(1).strip()
        assert expr in substitutions, f"unexpected interpolation ${{{expr}}} in {module}"
        return substitutions[expr]

    return re.sub(r"\$\{([^}]*)\}", interpolate, template.replace("\\'", "'"))


RULE_CASES = [
    ("search", None),
    ("cache", "[dbfanout-event-count] > 1"),
    ("audit.v2", "sys.Label = 'orders' AND [dbfanout-poller] IN ('a', 'b')"),
]


@pytest.mark.parametrize(("name", "user_filter"), RULE_CASES)
def test_the_bicep_rule_is_shared_topology_subscription_rule(name: str, user_filter: str | None) -> None:
    # Given a subscription with (or without) a filter; When infra builds its $Default rule
    # Then it is exactly what the code, the emulator config and validate use
    sub = SubscriptionConfig(name=name, handler="handlers.x:handle", filter=user_filter)
    assert bicep_rule(TOPIC_MODULE, name, user_filter or "") == subscription_rule(sub)
    assert f"[{PROP_TARGET}]" in subscription_rule(sub)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("'[dbfanout-to] IS NULL OR", "'[dbfanout-to] IS NULL AND"),  # the no-filter branch
        ("AND (${filters[i]}))", "AND ${filters[i]})"),  # the filter loses its parentheses
        ("[dbfanout-to] = \\'${s.name}\\''\n", "[dbfanout-target] = \\'${s.name}\\''\n"),  # another property
    ],
)
def test_a_rule_that_differs_from_the_code_is_caught(infra_copy: Path, old: str, new: str) -> None:
    # Given a copy whose rule template was changed; Then some subscription's rule no longer matches
    replace_once(infra_copy / "modules" / "servicebus-topic.bicep", old, new)
    mismatched = [
        (name, f)
        for name, f in RULE_CASES
        if bicep_rule(infra_copy / "modules" / "servicebus-topic.bicep", name, f or "")
        != subscription_rule(SubscriptionConfig(name=name, handler="h:h", filter=f))
    ]
    assert mismatched


def test_the_fixture_config_loads_and_its_deliveries_are_the_parameters() -> None:
    # Given the fixture config, read by the product's own loader
    config = parse_config(read_toml(FIXTURE_CONFIG), SETTINGS)
    topics = {t["name"]: t for t in parameter("topics")}
    # Then every topic poller's subscription has, in the parameters, the delivery count the worker
    # splits by and the rule built from its filter
    assert set(config.topics()) == {"products-changes"}
    for topic, poller in config.topics().items():
        subs = {s["name"]: s for s in topics[topic]["subscriptions"]}
        assert set(subs) == set(poller.subscriptions)
        for name, sub in poller.subscriptions.items():
            assert subs[name].get("maxDeliveryCount", 10) == poller.deliveries_for(name)
            assert bicep_rule(TOPIC_MODULE, name, subs[name].get("filter", "")) == subscription_rule(sub)


def read_toml(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def parameter(name: str, infra: Path = INFRA) -> Any:
    return json.loads((infra / "main.parameters.json").read_text(encoding="utf-8"))["parameters"][name]["value"]


# ---------------------------------------------------------------- config against the parameters


def topic_config(tmp_path: Path, extra: str = "", ledger: str = "", mail: str = "") -> Path:
    """The fixture config plus a topic poller `invoices` with subscriptions `ledger` and `mail`."""
    poller = (
        '[pollers.invoices]\nsource_url = "${ORDERS_DB_URL}"\ntable = "invoices"\ncursor = "updated_at"\n'
        f'pk = ["id"]\ntopic = "invoices-changes"\n{extra}\n'
        f'[pollers.invoices.subscriptions.ledger]\nhandler = "handlers.ledger:handle"\n{ledger}\n'
        f'[pollers.invoices.subscriptions.mail]\nhandler = "handlers.mail:handle"\n{mail}\n'
    )
    config = write_config(tmp_path, poller)
    parse_config(read_toml(config), SETTINGS)  # every config here is one the product accepts
    return config


def with_invoices_topic(infra: Path, *subscriptions: dict[str, Any], **topic: Any) -> None:
    """The repository's topics plus (or with a new) `invoices-changes` topic with these subscriptions."""
    topics = [*parameter("topics"), {"name": "invoices-changes", **topic, "subscriptions": list(subscriptions)}]
    pollers = [*parameter("pollers"), {"name": "invoices", "scheduleSeconds": 5, "kind": "keyset"}]  # its alerts
    edit_parameters(infra, topics=topics, pollers=pollers)


def test_a_topic_poller_with_its_topic_and_subscriptions_passes(
    consistency: ModuleType, infra_copy: Path, tmp_path: Path
) -> None:
    config = topic_config(tmp_path, ledger="max_delivery_count = 3", mail='filter = "[dbfanout-event-count] = 1"')
    with_invoices_topic(
        infra_copy,
        {"name": "ledger", "maxDeliveryCount": 3},
        {"name": "mail", "filter": "[dbfanout-event-count] = 1"},
    )
    assert consistency.check_all(infra_copy, [config]) == []


def test_a_topic_poller_without_its_topic_is_named(consistency: ModuleType, tmp_path: Path) -> None:
    problems = consistency.check_config(INFRA, topic_config(tmp_path))
    assert [p.message for p in problems] == [
        "pollers.invoices.topic = 'invoices-changes' has no entry in the topics parameter of main.parameters.json"
    ]


def test_a_configured_subscription_missing_from_the_topic_is_named(
    consistency: ModuleType, infra_copy: Path, tmp_path: Path
) -> None:
    with_invoices_topic(infra_copy, {"name": "ledger"})
    problems = consistency.check_config(infra_copy, topic_config(tmp_path))
    assert checks_of(problems) == {"subscriptions"}
    assert [p.severity for p in problems] == ["error"]
    assert problems[0].message.startswith("pollers.invoices.subscriptions.mail has no entry in the subscriptions")


def test_an_extra_subscription_is_a_warning_not_an_error(
    consistency: ModuleType, infra_copy: Path, tmp_path: Path
) -> None:
    # Given a subscription in the parameters that no [pollers.X.subscriptions.NAME] names
    with_invoices_topic(infra_copy, {"name": "ledger"}, {"name": "mail"}, {"name": "bi-export"})
    problems = consistency.check_config(infra_copy, topic_config(tmp_path))
    # Then it is reported (it gets every message) but does not fail the gate
    assert [(p.check, p.severity) for p in problems] == [("subscriptions", "warning")]
    assert "'bi-export'" in problems[0].message and str(problems[0]).startswith("WARNING CONSISTENCY")


@pytest.mark.parametrize(
    ("poller", "ledger", "infra_count", "ok"),
    [
        ("", "", None, True),  # both default to 10
        ("", "", 5, False),
        ("max_delivery_count = 4", "", 4, True),  # the poller's count is the subscriptions' default
        ("max_delivery_count = 4", "", None, False),
        ("max_delivery_count = 4", "max_delivery_count = 6", 6, True),  # the subscription's own wins
        ("max_delivery_count = 4", "max_delivery_count = 6", 4, False),
    ],
)
def test_max_delivery_count_must_match_the_subscription(
    consistency: ModuleType,
    infra_copy: Path,
    tmp_path: Path,
    poller: str,
    ledger: str,
    infra_count: int | None,
    ok: bool,
) -> None:
    ledger_entry: dict[str, Any] = {"name": "ledger"}
    if infra_count is not None:
        ledger_entry["maxDeliveryCount"] = infra_count
    mail_entry = {"name": "mail", "maxDeliveryCount": 4} if poller else {"name": "mail"}
    with_invoices_topic(infra_copy, ledger_entry, mail_entry)
    problems = consistency.check_config(infra_copy, topic_config(tmp_path, extra=poller, ledger=ledger))
    assert checks_of(problems) == (set() if ok else {"max-delivery"}), problems


def test_sessions_must_match_every_subscription(consistency: ModuleType, infra_copy: Path, tmp_path: Path) -> None:
    config = topic_config(tmp_path, extra="sessions = true")
    with_invoices_topic(infra_copy, {"name": "ledger", "requiresSession": True}, {"name": "mail"})
    problems = consistency.check_config(infra_copy, config)
    assert checks_of(problems) == {"sessions"} and "'mail'" in problems[0].message
    with_invoices_topic(
        infra_copy, {"name": "ledger", "requiresSession": True}, {"name": "mail", "requiresSession": True}
    )
    assert consistency.check_config(infra_copy, config) == []


@pytest.mark.parametrize(
    ("configured", "deployed"),
    [
        ("[dbfanout-event-count] = 1", None),
        (None, "[dbfanout-event-count] = 1"),
        ("[dbfanout-event-count] = 1", "[dbfanout-event-count]=1"),
    ],
)
def test_the_filter_must_be_the_configs(
    consistency: ModuleType, infra_copy: Path, tmp_path: Path, configured: str | None, deployed: str | None
) -> None:
    mail = f"filter = {json.dumps(configured)}" if configured else ""
    mail_entry: dict[str, Any] = {"name": "mail"} | ({"filter": deployed} if deployed else {})
    with_invoices_topic(infra_copy, {"name": "ledger"}, mail_entry)
    problems = consistency.check_config(infra_copy, topic_config(tmp_path, mail=mail))
    assert checks_of(problems) == {"filters"} and "pollers.invoices.subscriptions.mail.filter" in problems[0].message


def test_a_topic_window_shorter_than_the_redelivery_horizon_fails(
    consistency: ModuleType, infra_copy: Path, tmp_path: Path
) -> None:
    config = topic_config(tmp_path, extra="lease_ttl_seconds = 600")
    with_invoices_topic(infra_copy, {"name": "ledger"}, {"name": "mail"})
    problems = consistency.check_config(infra_copy, config)
    assert checks_of(problems) == {"dup-window"} and problems[0].message.startswith("topic 'invoices-changes'")
    # When the topic sets its own window: clean
    with_invoices_topic(infra_copy, {"name": "ledger"}, {"name": "mail"}, duplicateDetectionHistoryTimeWindow="PT45M")
    assert consistency.check_config(infra_copy, config) == []


# -------------------------------------------------------------------- the topics parameter's shape


@pytest.mark.parametrize(
    ("topics", "message"),
    [
        (
            [{"name": "orders-changes", "subscriptions": [{"name": "a"}]}],
            "'orders-changes' is both a queue and a topic",
        ),
        ([{"name": "t"}], "topic 't' needs subscriptions"),
        ([{"name": "t", "subscriptions": []}], "topic 't' needs subscriptions"),
        ([{"name": "t", "subscriptions": [{"maxDeliveryCount": 3}]}], "every subscription of topic 't' needs a name"),
        ([{"name": "t", "subscriptions": [{"name": "a"}, {"name": "a"}]}], "topic 't' lists subscription 'a' twice"),
        ([{"subscriptions": [{"name": "a"}]}], "topics[0] has no name"),
        (
            [{"name": "t", "subscriptions": [{"name": "a"}]}, {"name": "t", "subscriptions": [{"name": "b"}]}],
            "topic 't' is listed twice",
        ),
    ],
)
def test_a_malformed_topics_parameter_is_named(
    consistency: ModuleType, infra_copy: Path, topics: list[Any], message: str
) -> None:
    assert consistency.check_topics_parameter(INFRA) == []
    edit_parameters(infra_copy, topics=topics)
    problems = consistency.check_topics_parameter(infra_copy)
    assert len(problems) == 1 and problems[0].message.startswith(message), problems


# ------------------------------------------------------------------- least privilege on topics


def test_the_app_gets_sender_on_the_topic_and_receiver_on_each_subscription_only() -> None:
    text = RBAC_TOPIC_MODULE.read_text(encoding="utf-8")
    assignments = dict(
        re.findall(
            r"^resource (\w+) 'Microsoft\.Authorization/roleAssignments@[^']+' = [^\n]*\n\s*scope: (\w+)",
            text,
            re.MULTILINE,
        )
    )
    assert assignments == {"senderOnTopic": "topic", "receiverOnSubscription": "topicSubscription"}
    assert "entityRoles.serviceBusDataSender)" in text.split("resource receiverOnSubscription")[0]
    assert "entityRoles.serviceBusDataReceiver)" in text.split("resource receiverOnSubscription")[1]


def test_the_repository_scopes_every_service_bus_data_role_to_an_entity(consistency: ModuleType) -> None:
    assert [p for p in consistency.check_roles(INFRA) if p.check == "role-scope"] == []


@pytest.mark.parametrize(
    ("rel", "old", "new", "named"),
    [
        ("modules/rbac-topic.bicep", "  scope: topic\n", "  scope: namespace\n", "senderOnTopic"),
        ("modules/rbac-topic.bicep", "  scope: topicSubscription[i]\n", "", "receiverOnSubscription"),
        (
            "modules/rbac.bicep",
            "  scope: queue[i]\n  name: guid(queue[i].id, principalId, roles.serviceBusDataSender)",
            "  scope: namespace\n  name: guid(queue[i].id, principalId, roles.serviceBusDataSender)",
            "senderOnQueue",
        ),
    ],
)
def test_a_service_bus_data_role_on_the_namespace_or_resource_group_fails(
    consistency: ModuleType, infra_copy: Path, rel: str, old: str, new: str, named: str
) -> None:
    replace_once(infra_copy / rel, old, new)
    problems = [p for p in consistency.check_roles(infra_copy) if p.check == "role-scope"]
    assert [p.message.split()[0] for p in problems] == [named] and problems[0].where == f"infra/{rel}"


# ------------------------------------------------------------------------ the gate's warnings


def test_the_gate_passes_with_warnings_and_fails_with_errors(
    infra_python: Path, infra_copy: Path, tmp_path: Path
) -> None:
    validate = [str(infra_python), str(REPO_INFRA / "validate.py"), "--skip-checkov", "--config"]
    config = topic_config(tmp_path)
    # Given a subscription no handler consumes: a warning, exit 0
    with_invoices_topic(infra_copy, {"name": "ledger"}, {"name": "mail"}, {"name": "bi-export"})
    proc = subprocess.run([*validate, str(config), str(infra_copy)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING CONSISTENCY subscriptions" in proc.stdout
    assert proc.stdout.strip().endswith("OK, 1 warning(s) (syntax, suppressions, consistency)")
    # Given a configured subscription missing too: an error, exit 1
    with_invoices_topic(infra_copy, {"name": "ledger"}, {"name": "bi-export"})
    proc = subprocess.run([*validate, str(config), str(infra_copy)], capture_output=True, text=True, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED, 1 problem(s), 1 warning(s)" in proc.stdout
