"""Rule filters and topic configuration, without a server."""

from __future__ import annotations

from typing import Any

import pytest
from proton import Message

from sbemulator import ConfigError, EmulatorConfig
from sbemulator.filters import CorrelationFilter, MessageView, Rule, SqlFilter


def _view(**kw: Any) -> MessageView:
    return MessageView.of(bytes(Message(body=b"x", **kw).encode()))


MSG = _view(subject="order", id="m-1", correlation_id="c-1", properties={"color": "red", "qty": 12, "vip": True})


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("sys.Label = 'order'", True),
        ("sys.label = 'order' AND color = 'red'", True),
        ("color IN ('blue', 'red')", True),
        ("color NOT IN ('blue', 'red')", False),
        ("NOT color = 'red'", False),
        ("color <> 'red' OR qty > 10", True),
        ("qty >= 12 AND qty < 13 AND qty != 5", True),
        ("user.color = 'red' AND sys.MessageId = 'm-1' AND sys.CorrelationId = 'c-1'", True),
        ("missing = 'x'", False),
        ("NOT missing = 'x'", False),  # unknown stays unknown: three-valued logic
        ("missing IS NULL AND color IS NOT NULL", True),
        ("EXISTS(color) AND NOT EXISTS(missing)", True),
        ("color LIKE 'r%' AND sys.Label LIKE '_rder'", True),
        ("(color = 'blue' OR color = 'red') AND (qty = 1 OR vip = TRUE)", True),
        ("1 = 1", True),
        ("1 = 0", False),
        ("sys.Label = 'it''s'", False),
    ],
)
def test_sql_filter(expression: str, expected: bool):
    assert SqlFilter.compile(expression)(MSG) is expected


@pytest.mark.parametrize(
    "bad", ["color =", "color = 'red' AND", "qty + 1 = 2", "sys.Nope = 1", "color 'red'", "(a = 1"]
)
def test_sql_filter_errors_name_the_expression(bad: str):
    with pytest.raises(ConfigError, match="SQL filter"):
        SqlFilter.compile(bad)


def test_correlation_filter_matches_all_given_fields():
    f = CorrelationFilter.from_json({"Label": "order", "Properties": {"color": "red", "qty": 12}}, "f")
    assert f(MSG)
    assert not CorrelationFilter.from_json({"Label": "order", "Properties": {"color": "blue"}}, "f")(MSG)
    assert not CorrelationFilter.from_json({"To": "someone"}, "f")(MSG)


OFFICIAL = """{"UserConfig": {"Namespaces": [{"Name": "sbemulatorns", "Queues": [{"Name": "queue.1"}],
  "Topics": [{"Name": "topic.1", "Properties": {"DefaultMessageTimeToLive": "PT1H",
      "DuplicateDetectionHistoryTimeWindow": "PT20S", "RequiresDuplicateDetection": false},
    "Subscriptions": [
      {"Name": "subscription.1", "Properties": {"DeadLetteringOnMessageExpiration": false,
        "DefaultMessageTimeToLive": "PT1H", "LockDuration": "PT1M", "MaxDeliveryCount": 3,
        "ForwardDeadLetteredMessagesTo": "", "ForwardTo": "", "RequiresSession": false},
       "Rules": [{"Name": "app-prop-filter-1", "Properties": {"FilterType": "Correlation",
         "CorrelationFilter": {"ContentType": "application/text", "CorrelationId": "id1", "Label": "subject1",
           "MessageId": "msgid1", "ReplyTo": "someQueue", "ReplyToSessionId": "sessionId",
           "SessionId": "session1", "To": "xyz"}}}]},
      {"Name": "subscription.2", "Rules": [{"Name": "user-prop-filter-1", "Properties": {
         "FilterType": "Correlation", "CorrelationFilter": {"Properties": {"prop3": "value3"}}}}]},
      {"Name": "subscription.3"}]}]}],
  "Logging": {"Type": "File"}}}"""


def test_the_official_sample_config_with_topics_parses():
    config = EmulatorConfig.from_json_text(OFFICIAL)
    (topic,) = config.topics
    assert [s.name for s in topic.subscriptions] == ["subscription.1", "subscription.2", "subscription.3"]
    assert topic.subscriptions[0].properties.max_delivery_count == 3
    assert topic.subscriptions[2].rules == ()
    prop3 = _view(properties={"prop3": "value3"})
    assert topic.subscriptions[1].rules[0].matches(prop3)
    assert not topic.subscriptions[0].rules[0].matches(prop3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t["Subscriptions"][0].update(Oops=1), "Oops"),
        (lambda t: t["Properties"].update(LockDuration="PT1M"), "LockDuration"),
        (lambda t: t["Subscriptions"][0]["Properties"].update(RequiresDuplicateDetection=True), "RequiresDuplicate"),
        (lambda t: t["Subscriptions"][0]["Properties"].update(ForwardTo="nowhere"), "nowhere"),
        (
            lambda t: t["Subscriptions"][0]["Rules"][0]["Properties"].update(Action={"SqlExpression": "SET a=1"}),
            "Action",
        ),
        (lambda t: t["Subscriptions"][0]["Rules"][0]["Properties"].update(FilterType="Bogus"), "FilterType"),
    ],
)
def test_topic_config_errors_are_never_silent(change: Any, message: str):
    import json

    doc = json.loads(OFFICIAL)
    change(doc["UserConfig"]["Namespaces"][0]["Topics"][0])
    with pytest.raises(ConfigError, match=message):
        EmulatorConfig.from_json_text(json.dumps(doc))


def test_unknown_namespace_keys_are_errors():
    with pytest.raises(ConfigError, match="Namespaces"):
        EmulatorConfig.from_json_text('{"UserConfig": {"Namespaces": [{"Name": "n", "Queus": []}]}}')


def test_a_rule_without_a_filter_type_defaults_to_correlation():
    rule = Rule.from_json({"Name": "r", "Properties": {"CorrelationFilter": {"Label": "order"}}}, "r")
    assert rule.matches(MSG)
