"""A topic poller's messages are worked per subscription: its handler, its deliveries, its split."""

from __future__ import annotations

import pytest

from shared.codec import decode_batch
from shared.config import Config, SubscriptionConfig
from shared.errors import ConfigError, EnvelopeError
from shared.ids import split_message_id, subscription_split_message_id
from shared.models import HandlerContext, RowChange
from shared.topology import PROP_TARGET
from tests.worker.support import POLLER, QUEUE, Handler, Sent, batch, delivery, event_ids, make_config
from worker.runtime import HandlerKey, Worker
from worker.settlement import Settle
from worker.split import PROP_SPLIT_FROM, Splitter

TOPIC = QUEUE  # a topic poller's ``queue`` holds its topic's name
SEEN: dict[str, list[HandlerContext]] = {"search": [], "audit": []}


def record_search(events: list[RowChange], context: HandlerContext) -> None:
    SEEN["search"].append(context)


def record_audit(events: list[RowChange], context: HandlerContext) -> None:
    SEEN["audit"].append(context)


def topic_config(**changes: object) -> Config:
    subs = {
        "search": SubscriptionConfig("search", f"{__name__}:record_search"),
        "audit": SubscriptionConfig("audit", f"{__name__}:record_audit", max_delivery_count=4),
    }
    return make_config(topic=TOPIC, subscriptions=subs, **changes)


def test_each_subscription_gets_its_own_configured_handler_loaded_once() -> None:
    # Given a topic poller whose two subscriptions name different handlers
    worker = Worker(topic_config())
    # When the worker looks them up (twice)
    search, audit = worker.handler_for(POLLER, "search"), worker.handler_for(POLLER, "audit")
    # Then each subscription has its own, cached per (poller, subscription)
    assert (search, audit) == (record_search, record_audit)
    assert worker.handler_for(POLLER, "search") is search


def test_the_message_goes_to_the_handler_of_the_subscription_it_was_received_on() -> None:
    # Given handlers for both subscriptions
    search, audit = Handler(), Handler()
    handlers: dict[HandlerKey, Handler] = {(POLLER, "search"): search, (POLLER, "audit"): audit}
    worker = Worker(topic_config(), handlers=handlers)
    # When one copy arrives on "audit"
    assert worker.process(delivery(batch(2), message_id="m-1"), "audit") is Settle.COMPLETE
    # Then only audit's handler ran, and its context names the subscription
    assert search.calls == []
    ((seen, context),) = audit.calls
    assert seen == ["ev-0", "ev-1"] and context.subscription == "audit" and context.message_id == "m-1"


def test_a_queue_message_has_no_subscription_in_its_context() -> None:
    handler = Handler()
    Worker(make_config(), handlers={POLLER: handler}).process(delivery(batch(1)))
    ((_, context),) = handler.calls
    assert context.subscription is None


def test_a_topic_message_without_its_subscription_fails_naming_the_key() -> None:
    # A consumer that forgets to pass the subscription must not run an arbitrary handler
    with pytest.raises(ConfigError) as raised:
        Worker(topic_config()).process(delivery(batch(1)))
    assert raised.value.key == f"pollers.{POLLER}.subscriptions"


def test_a_queue_message_received_on_a_subscription_is_refused() -> None:
    with pytest.raises(EnvelopeError, match="not to a topic"):
        Worker(make_config(handler="x:y")).process(delivery(batch(1)), "search")


def test_an_unknown_subscription_fails_naming_the_configured_ones() -> None:
    with pytest.raises(ConfigError, match="configured: audit, search"):
        Worker(topic_config()).process(delivery(batch(1)), "billing")


def test_each_subscription_splits_by_its_own_max_delivery_count() -> None:
    # Given split_after_deliveries out of reach, audit's MaxDeliveryCount 4 and search's default 10
    sent = Sent()
    failing: dict[HandlerKey, Handler] = {(POLLER, s): Handler(poison={"ev-1"}) for s in ("search", "audit")}
    worker = Worker(topic_config(split_after_deliveries=9), splitter=Splitter(topic_config(), sent), handlers=failing)
    # When the batch fails on its second delivery in each subscription
    # Then search retries it whole (8 deliveries left), audit splits it (2 left: within the crash margin)
    with pytest.raises(Exception, match="subscription search failed"):
        worker.process(delivery(batch(3), delivery_count=2), "search")
    assert sent.messages == []
    assert worker.process(delivery(batch(3), delivery_count=2, message_id="m-9"), "audit") is Settle.SPLIT
    ((queue, singles),) = sent.messages
    # And the singles go to the topic, addressed to audit alone
    assert queue == TOPIC and event_ids(singles) == [("ev-0",), ("ev-1",), ("ev-2",)]
    assert all(m.application_properties[PROP_TARGET] == "audit" for m in singles)
    assert all(m.application_properties[PROP_SPLIT_FROM] == "m-9" for m in singles)


def test_split_ids_include_the_subscription_and_stay_deterministic() -> None:
    splitter = Splitter(topic_config(), Sent())
    search = splitter.singles(batch(3), "msg-parent", "search")
    audit = splitter.singles(batch(3), "msg-parent", "audit")
    # deterministic: a re-split after a crash gives the same messages (the topic drops the copies)
    assert Splitter(topic_config(), Sent()).singles(batch(3), "msg-parent", "search") == search
    assert [m.message_id for m in search] == [subscription_split_message_id(f"ev-{i}", "search") for i in range(3)]
    # distinct across subscriptions and from a queue's split ids: no subscription's singles are dropped
    ids = {m.message_id for m in search} | {m.message_id for m in audit}
    assert len(ids) == 6 and not ids & {split_message_id(f"ev-{i}") for i in range(3)}
    assert all(len(i) <= 128 for i in ids)  # the Service Bus limit on message ids
    # the bodies are the queue's singles, unchanged
    queue_singles = splitter.singles(batch(3), "msg-parent")
    assert [decode_batch(m.body) for m in search] == [decode_batch(m.body) for m in queue_singles]
    assert all(PROP_TARGET not in m.application_properties for m in queue_singles)


def test_the_subscription_split_id_format_is_pinned() -> None:
    # A re-split after an upgrade must produce the same ids as before it, or the topic keeps both copies
    assert subscription_split_message_id("ev-1", "search") == "split-search:ev-1"


def test_singles_of_a_session_topic_keep_their_keys_session() -> None:
    singles = Splitter(topic_config(sessions=True), Sent()).singles(batch(2), "msg-parent", "search")
    assert [m.session_id for m in singles] == ["id=0", "id=1"]
