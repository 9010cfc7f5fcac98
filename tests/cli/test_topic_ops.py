"""The operator surface of a topic poller against the emulator: dlq TOPIC/SUBSCRIPTION, status, validate."""

from __future__ import annotations

import json
import tomllib
import uuid

import pytest
from azure.servicebus import ServiceBusMessage

from dbfanout.ops.bus import Entity, peek_all
from dbfanout.ops.checks import Check
from dbfanout.ops.topic_checks import SubscriptionFacts, TopicFacts, rule_check, topology_checks
from shared.config import PollerConfig, parse_config
from shared.topology import PROP_TARGET, RULE_NAME, subscription_rule
from tests.cli.conftest import dead_letter_in_subscription, said, topic_workspace_of

pytestmark = pytest.mark.integration


def stats(workspace, sub: str) -> dict[str, int]:
    counts: dict[str, int] = workspace.emulator.queue_stats(f"{workspace.queue}/Subscriptions/{sub}")
    return counts


# ---- dlq -------------------------------------------------------------------------------------


def test_peek_and_export_read_the_dead_letter_queue_of_one_subscription(topic_workspace, bus, tmp_path):
    # Given two messages dead-lettered in search (audit handled its copies)
    ws = topic_workspace
    ids = dead_letter_in_subscription(bus, ws.queue, "search", [b'{"n": 1}', b'{"n": 2}'])
    # When the operator peeks and exports TOPIC/search, and peeks TOPIC/audit
    peeked = ws.run("dlq", "peek", f"{ws.queue}/search", "--json")
    other = ws.run("dlq", "peek", f"{ws.queue}/audit", "--json")
    out = tmp_path / "dead.jsonl"
    exported = ws.run("dlq", "export", f"{ws.queue}/search", "--out", str(out), "--json")
    # Then search's DLQ shows both with their reason, audit's is empty, the export holds both bodies
    assert peeked.exit_code == 0, said(peeked)
    assert sorted(m["message_id"] for m in json.loads(peeked.stdout)) == sorted(ids)
    assert {m["dead_letter_reason"] for m in json.loads(peeked.stdout)} == {"HandlerFailed"}
    assert other.exit_code == 0 and json.loads(other.stdout) == []
    assert exported.exit_code == 0 and json.loads(exported.stdout)["exported"] == 2
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["body"] for line in lines) == ['{"n": 1}', '{"n": 2}']
    # (peek and export leave the messages where they were)
    assert stats(ws, "search")["dead_lettered"] == 2


def test_replay_of_a_subscription_reaches_that_subscription_only_with_new_ids(topic_workspace, bus):
    # Given three messages dead-lettered in search; audit handled its copies and is empty
    ws = topic_workspace
    ids = dead_letter_in_subscription(bus, ws.queue, "search", [b'{"n": 1}', b'{"n": 2}', b'{"n": 3}'])
    assert stats(ws, "audit")["messages"] == 0
    # When the operator replays search's DLQ
    result = ws.run("dlq", "replay", f"{ws.queue}/search", "--all", "--yes", "--json")
    # Then the copies are in search (new ids, provenance, addressed to search), its DLQ is empty,
    # and audit never saw a replay
    assert result.exit_code == 0, said(result)
    report = json.loads(result.stdout)
    assert report["replayed"] == 3 and report["source"] == report["target"] == f"{ws.queue}/search"
    copies = list(peek_all(bus, Entity(ws.queue, "search"), dead_letter=False))
    assert len(copies) == 3
    assert sorted(c.application_properties["dbfanout-replay-of"] for c in copies) == sorted(ids)
    assert all(c.message_id not in ids for c in copies)
    assert {c.application_properties[PROP_TARGET] for c in copies} == {"search"}
    assert {c.body for c in copies} == {b'{"n": 1}', b'{"n": 2}', b'{"n": 3}'}
    assert stats(ws, "search")["dead_lettered"] == 0
    assert stats(ws, "audit")["messages"] == 0 and stats(ws, "audit")["dead_lettered"] == 0


def test_two_subscriptions_replaying_the_same_batch_both_get_their_copy(topic_workspace, bus):
    # Given one message dead-lettered in both subscriptions (the topic has duplicate detection on)
    ws = topic_workspace
    (mid,) = dead_letter_in_subscription(bus, ws.queue, "search", [b'{"n": 1}'], others=())
    with bus.get_subscription_receiver(ws.queue, "audit", max_wait_time=5) as receiver:
        (message,) = receiver.receive_messages(1, max_wait_time=5)
        receiver.dead_letter_message(message, reason="HandlerFailed")
    # When each subscription's DLQ is replayed
    for sub in ("search", "audit"):
        result = ws.run("dlq", "replay", f"{ws.queue}/{sub}", "--all", "--yes", "--json")
        assert result.exit_code == 0, said(result)
    # Then each subscription holds exactly one copy: the second copy was not dropped as a duplicate
    search = list(peek_all(bus, Entity(ws.queue, "search"), dead_letter=False))
    audit = list(peek_all(bus, Entity(ws.queue, "audit"), dead_letter=False))
    assert len(search) == len(audit) == 1
    assert search[0].message_id != audit[0].message_id
    assert search[0].application_properties["dbfanout-replay-of"] == audit[0].application_properties[
        "dbfanout-replay-of"
    ] == mid  # fmt: skip


def test_replay_of_a_session_subscription_keeps_the_session_id(tmp_path, azurite, servicebus, monkeypatch, bus):
    # Given a session-enabled subscription whose message for key k1 was dead-lettered
    ws = topic_workspace_of(
        tmp_path, azurite, servicebus, monkeypatch,
        search={"Properties": {"MaxDeliveryCount": 3, "RequiresSession": True}}, audit={"omit": True},
    )  # fmt: skip
    with bus.get_topic_sender(ws.queue) as sender:
        sender.send_messages(ServiceBusMessage(b'{"n": 1}', message_id="m-k1", session_id="k1"))
    with bus.get_subscription_receiver(ws.queue, "search", session_id="k1", max_wait_time=5) as receiver:
        (message,) = receiver.receive_messages(1, max_wait_time=5)
        receiver.dead_letter_message(message, reason="HandlerFailed")
    # When its DLQ (not session-enabled) is replayed
    result = ws.run("dlq", "replay", f"{ws.queue}/search", "--all", "--yes", "--json")
    # Then the copy is back in session k1 of that subscription
    assert result.exit_code == 0, said(result)
    with bus.get_subscription_receiver(ws.queue, "search", session_id="k1", max_wait_time=5) as receiver:
        (copy,) = receiver.peek_messages(5)
    assert copy.session_id == "k1" and copy.message_id != "m-k1"
    assert stats(ws, "search")["dead_lettered"] == 0


def test_replay_dry_run_and_sequence_selection_on_a_subscription(topic_workspace, bus):
    # Given two dead-lettered messages in audit
    ws = topic_workspace
    dead_letter_in_subscription(bus, ws.queue, "audit", [b'{"n": 1}', b'{"n": 2}'], others=("search",))
    (first, second) = peek_all(bus, Entity(ws.queue, "audit"))
    # When the operator dry-runs, then replays one sequence number
    dry = ws.run("dlq", "replay", f"{ws.queue}/audit", "--all", "--dry-run", "--json")
    one = ws.run("dlq", "replay", f"{ws.queue}/audit", "--sequence", str(second.sequence_number), "--yes")
    # Then the dry run changed nothing and the replay moved exactly that one
    assert dry.exit_code == 0 and json.loads(dry.stdout)["selected"] == 2
    assert one.exit_code == 0, said(one)
    assert f"replayed 1 of 1 selected message(s) from {ws.queue}/audit into {ws.queue}/audit" in said(one)
    assert [v.message_id for v in peek_all(bus, Entity(ws.queue, "audit"))] == [first.message_id]
    assert stats(ws, "audit")["active"] == 1 and stats(ws, "search")["messages"] == 0


def test_purge_empties_one_subscriptions_dead_letter_queue_only(topic_workspace, bus):
    ws = topic_workspace
    dead_letter_in_subscription(bus, ws.queue, "search", [b"a", b"b"], others=())
    with bus.get_subscription_receiver(ws.queue, "audit", max_wait_time=5) as receiver:
        for message in receiver.receive_messages(2, max_wait_time=5):
            receiver.dead_letter_message(message, reason="HandlerFailed")
    assert stats(ws, "audit")["dead_lettered"] == 2
    # When search's DLQ is purged
    result = ws.run("dlq", "purge", f"{ws.queue}/search", "--yes", "--json")
    # Then it is empty and audit's is untouched
    assert result.exit_code == 0, said(result)
    assert json.loads(result.stdout)["purged"] == 2
    assert stats(ws, "search")["dead_lettered"] == 0 and stats(ws, "audit")["dead_lettered"] == 2


def test_unknown_subscription_bare_topic_and_to_are_refused_with_what_to_do(topic_workspace):
    ws = topic_workspace
    # When the subscription is not configured; Then the error names the configured ones
    unknown = ws.run("dlq", "peek", f"{ws.queue}/billing")
    assert unknown.exit_code != 0
    assert "no such subscription (configured: audit, search)" in said(unknown)
    # When the topic is named without a subscription; Then the error lists TOPIC/SUB names
    bare = ws.run("dlq", "replay", ws.queue, "--all", "--yes")
    assert bare.exit_code != 0 and f"{ws.queue}/audit, {ws.queue}/search" in said(bare)
    # When --to is given for a subscription; Then it is refused (nothing was sent)
    to = ws.run("dlq", "replay", f"{ws.queue}/search", "--all", "--to", "elsewhere", "--yes")
    assert to.exit_code == 2 and "replayed into that subscription only" in said(to)


# ---- status ----------------------------------------------------------------------------------


def test_status_shows_each_subscriptions_depth_and_dead_letters(topic_workspace, bus):
    # Given search: 2 active + 1 dead-lettered; audit: 2 active + 0 dead-lettered
    ws = topic_workspace
    dead_letter_in_subscription(bus, ws.queue, "search", [b"x"], others=("audit",))
    with bus.get_topic_sender(ws.queue) as sender:
        sender.send_messages([ServiceBusMessage(b"a"), ServiceBusMessage(b"b")])
    # When status runs (JSON and human)
    result = ws.run("status", "--json")
    human = ws.run("status", "--wide")
    # Then the topic and each subscription's numbers are shown; the queue_depth sums them
    (row,) = json.loads(result.stdout)
    assert row["topic"] == row["queue"] == ws.queue
    subs = {s["name"]: (s["active"], s["dead_letter"]) for s in row["subscriptions"]}
    assert subs == {"audit": (2, 0), "search": (2, 1)}
    assert (row["queue_depth"]["active"], row["queue_depth"]["dead_lettered"]) == (4, 1)
    text = said(human)
    assert f"{ws.queue} (topic)" in text
    assert "search: 2 active, 1 DLQ" in text and "audit: 2 active, 0 DLQ" in text
    # And the dead letter is a problem that names its subscription (exit 1)
    compact = ws.run("status")
    assert human.exit_code == compact.exit_code == 1
    assert f"1 dead-lettered message(s) in {ws.queue}/search" in said(compact) and "/audit" not in said(compact)


def test_status_reports_a_missing_subscription_and_still_shows_the_rest(tmp_path, azurite, servicebus, monkeypatch):
    ws = topic_workspace_of(tmp_path, azurite, servicebus, monkeypatch, audit={"omit": True})
    result = ws.run("status", "--json")
    (row,) = json.loads(result.stdout)
    subs = {s["name"]: s for s in row["subscriptions"]}
    assert (subs["search"]["active"], subs["search"]["dead_letter"]) == (0, 0)
    assert subs["audit"]["error"] == f"peek: subscription {ws.queue}/audit does not exist"
    assert "audit" in row["queue_depth"]["error"]


# ---- validate --------------------------------------------------------------------------------


def checks_of(result) -> dict[str, tuple[str, str]]:
    return {c["name"]: (c["status"], c["detail"]) for c in json.loads(result.stdout)["checks"]}


def test_validate_passes_a_correct_topology_and_imports_every_subscriptions_handler(topic_workspace):
    ws = topic_workspace
    ws.source.upsert([1, 2])
    result = ws.run("validate", "--json")
    assert result.exit_code == 0, said(result)
    checks = checks_of(result)
    for name in ("topic", "subscription [search]", "subscription [audit]", "sessions [search]", "sessions [audit]",
                 "handler [search]", "handler [audit]"):  # fmt: skip
        assert checks[name][0] == "ok", (name, checks[name])
    assert checks["topic properties"][0] == "skip"  # the emulator has no management API


def test_validate_fails_on_a_missing_subscription_and_says_how_to_create_it(tmp_path, azurite, servicebus, monkeypatch):
    ws = topic_workspace_of(tmp_path, azurite, servicebus, monkeypatch, audit={"omit": True})
    result = ws.run("validate", "--json")
    assert result.exit_code == 1
    status, detail = checks_of(result)["subscription [audit]"]
    assert status == "fail" and "does not exist" in detail and "[dbfanout-to] = 'audit'" in detail
    assert checks_of(result)["subscription [search]"][0] == "ok"


def test_validate_fails_when_a_subscription_requires_sessions_the_config_does_not_use(
    tmp_path, azurite, servicebus, monkeypatch
):
    ws = topic_workspace_of(
        tmp_path, azurite, servicebus, monkeypatch,
        search={"Properties": {"MaxDeliveryCount": 3, "RequiresSession": True}},
    )  # fmt: skip
    result = ws.run("validate", "--json")
    assert result.exit_code == 1
    status, detail = checks_of(result)["sessions [search]"]
    assert status == "fail" and "requires sessions but sessions = false" in detail
    assert checks_of(result)["sessions [audit]"][0] == "ok"


def test_validate_fails_on_a_missing_topic_and_a_broken_handler(tmp_path, azurite, servicebus, monkeypatch):
    # Given a config naming a topic that does not exist, and audit's handler module lacks audit()
    ws = topic_workspace_of(tmp_path, azurite, servicebus, monkeypatch)
    module = f"handlers_{uuid.uuid4().hex[:8]}"  # a fresh module: the CLI runs in this process
    (tmp_path / f"{module}.py").write_text("def search(events, context):\n    pass\n")
    text = ws.config_path.read_text().replace(ws.queue, "no-such-topic")
    ws.config_path.write_text(text.replace("topic_handlers:audit", f"{module}:audit"))
    result = ws.run("validate", "--json")
    assert result.exit_code == 1
    checks = checks_of(result)
    assert checks["topic"][0] == "fail" and "no-such-topic does not exist" in checks["topic"][1]
    assert checks["handler [search]"][0] == "ok"
    assert checks["handler [audit]"][0] == "fail" and "subscriptions.audit.handler" in checks["handler [audit]"][1]


# ---- what the management API shows (Azure only: the emulator has none), decided purely --------

TOPOLOGY = """
[app]
name = "shop"

[pollers.orders]
source_url = "sqlite://"
table = "orders"
cursor = "updated_at"
pk = ["id"]
topic = "orders-changes"
lease_ttl_seconds = 60

[pollers.orders.subscriptions.search]
handler = "handlers.search:handle"

[pollers.orders.subscriptions.audit]
handler = "handlers.audit:handle"
filter = "[dbfanout-event-count] > 0"
max_delivery_count = 4
"""


def _topology_poller() -> PollerConfig:
    return parse_config(tomllib.loads(TOPOLOGY), {}).poller("orders")


def _facts(poller: PollerConfig, **subs: SubscriptionFacts) -> TopicFacts:
    """The management API's view of a topic that infra/ created as the config says, changed by ``subs``."""
    correct = {
        name: SubscriptionFacts(poller.deliveries_for(name), 60.0, {RULE_NAME: subscription_rule(sub)})
        for name, sub in poller.subscriptions.items()
    }
    return TopicFacts(True, 600.0, 256 * 1024, correct | subs)


def _by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_topology_checks_pass_what_infra_creates():
    # Given the topology the config asks for; When checked; Then every check holds
    poller = _topology_poller()
    checks = list(topology_checks(poller, _facts(poller)))
    assert {c.status for c in checks} == {"ok"}, [c for c in checks if c.status != "ok"]
    assert {"rule [search]", "rule [audit]", "max delivery count [audit]", "duplicate detection"} <= {
        c.name for c in checks
    }


def test_topology_checks_fail_a_wrong_rule_and_say_what_it_breaks_and_how_to_fix_it():
    poller = _topology_poller()
    match_all = SubscriptionFacts(10, 60.0, {RULE_NAME: "1=1"})
    extra_rule = SubscriptionFacts(4, 60.0, {RULE_NAME: subscription_rule(poller.subscription("audit")), "more": "x=1"})
    checks = _by_name(list(topology_checks(poller, _facts(poller, search=match_all, audit=extra_rule))))
    search = checks["rule [search]"]
    assert search.status == "fail"
    assert "'1=1'" in search.detail and "reach the wrong subscriptions" in search.detail
    assert "[dbfanout-to] IS NULL OR [dbfanout-to] = 'search'" in search.detail  # the rule to set
    assert checks["rule [audit]"].status == "fail" and "extra rule(s) more" in checks["rule [audit]"].detail
    missing = SubscriptionFacts(10, 60.0, {})
    assert rule_check(poller, "search", missing.rules).detail.startswith("$Default is missing")


def test_topology_checks_warn_on_a_max_delivery_count_other_than_the_configured_one():
    poller = _topology_poller()
    checks = _by_name(list(topology_checks(poller, _facts(poller, audit=SubscriptionFacts(10, 60.0, {
        RULE_NAME: subscription_rule(poller.subscription("audit"))})))))  # fmt: skip
    audit = checks["max delivery count [audit]"]
    assert audit.status == "warn"
    assert "the poller assumes 4: set pollers.orders.subscriptions.audit.max_delivery_count = 10" in audit.detail
    assert checks["max delivery count [search]"].status == "ok"


def test_topology_checks_warn_on_subscriptions_the_config_does_not_name():
    poller = _topology_poller()
    checks = _by_name(list(topology_checks(poller, _facts(poller, billing=SubscriptionFacts(10, 60.0, {})))))
    billing = checks["subscription [billing]"]
    assert billing.status == "warn" and "receives a copy of every batch" in billing.detail
    assert "rule [billing]" not in checks  # not ours: its rules are not judged


def test_topology_checks_fail_a_topic_without_duplicate_detection():
    poller = _topology_poller()
    facts = _facts(poller)
    off = TopicFacts(False, 0.0, facts.max_message_bytes, facts.subscriptions)
    check = _by_name(list(topology_checks(poller, off)))["duplicate detection"]
    assert check.status == "fail" and "recreate the topic" in check.detail
