"""Metrics and traces of the worker and the poller's send (issue 24), through an in-memory SDK.

The poller's send span stamps each message; the worker's delivery span continues that trace from
the Service Bus properties or, for storage queues, from the envelope. The commit -> handler
histogram gets one observation per event, labelled by where its commit time came from; a poisoned
event counts as dead-lettered once, on its last allowed delivery.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from poller.sinks.queue import QueueSink
from shared.codec import decode_batch, encode_batch
from shared.config import AppConfig, Config
from shared.messages import OutgoingMessage, pack_batch
from shared.models import Batch, HandlerContext, RowChange
from shared.tracing import PROP_DIAGNOSTIC_ID, PROP_TRACEPARENT
from tests.support import otel
from tests.worker.support import Handler, Sent, make_poller
from worker.handlers import Handler as HandlerFn
from worker.runtime import Delivery, Worker
from worker.split import Splitter

SECRET = "S3CRETspan=="
_AGO = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=30)  # a commit 30 s before the test module loaded


@pytest.fixture(autouse=True)
def sdk() -> Iterator[None]:
    otel.install()
    otel.SPANS.clear()
    yield


@dataclass
class Collecting:
    """A sender that keeps what the sink sent (the bodies and properties under test)."""

    sent: list[OutgoingMessage] = field(default_factory=list)

    def send_all(self, messages: Sequence[OutgoingMessage]) -> None:
        self.sent.extend(messages)

    def close(self) -> None:
        return None


def _traceparent(span: ReadableSpan) -> str:
    ctx = span.context
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _poller_name() -> str:
    return f"orders-{uuid.uuid4().hex[:6]}"


def _batch(poller: str, n: int, **event_changes: Any) -> Batch:
    events = tuple(
        replace(RowChange(f"ev-{poller}-{i}", "upsert", {"id": i}, i, {"id": i}, poller), **event_changes)
        for i in range(n)
    )
    return Batch(poller, f"b-{poller}", "sha256:f", events)


def _worker(poller: str, handler: HandlerFn, **changes: object) -> Worker:
    config = Config(AppConfig("app"), {poller: replace(make_poller(**changes), name=poller)})
    return Worker(config, splitter=Splitter(config, Sent()), handlers={poller: handler})


def _send(poller: str, batch: Batch) -> list[OutgoingMessage]:
    sender = Collecting()
    QueueSink(replace(make_poller(), name=poller), sender, limit=256 * 1024).send(batch)
    return sender.sent


def _delivery(message: OutgoingMessage, *, count: int = 1, properties: bool = True) -> Delivery:
    return Delivery(
        body=message.body,
        message_id=message.message_id,
        delivery_count=count,
        enqueued_time=dt.datetime.now(dt.UTC),
        application_properties=dict(message.application_properties) if properties else {},
    )


@pytest.mark.parametrize("carrier", ["servicebus-properties", "storage-queue-envelope"])
def test_the_worker_span_continues_the_trace_of_the_poller_send_span(carrier: str) -> None:
    # Given a page sent through the poller's sink (a span per page)
    poller = _poller_name()
    (message,) = _send(poller, _batch(poller, 3))
    (send,) = otel.spans("dbfanout.send")
    traceparent = _traceparent(send)
    # Then the message carries the send span's context: properties (Service Bus) and envelope
    assert message.application_properties[PROP_TRACEPARENT] == traceparent
    assert message.application_properties[PROP_DIAGNOSTIC_ID] == traceparent
    assert decode_batch(message.body).traceparent == traceparent
    # When the worker handles it (a storage queue has no properties: the envelope carries it)
    _worker(poller, Handler()).process(_delivery(message, properties=carrier == "servicebus-properties"))
    (deliver,) = otel.spans("dbfanout.deliver")
    # Then its span is the send span's child, in the same trace, with the delivery's attributes
    assert deliver.context.trace_id == send.context.trace_id
    assert deliver.parent is not None and deliver.parent.span_id == send.context.span_id
    assert send.kind is SpanKind.PRODUCER and deliver.kind is SpanKind.CONSUMER
    attrs = dict(deliver.attributes or {})
    assert attrs["dbfanout.poller"] == poller and attrs["messaging.message.id"] == message.message_id
    assert attrs["dbfanout.delivery_count"] == 1 and attrs["dbfanout.events"] == 3
    assert attrs["messaging.destination.name"] == "orders-changes"


def test_stamping_keeps_message_ids_and_old_bodies_still_decode() -> None:
    # Given the same page packed plain and sent with a trace and a read time
    poller = _poller_name()
    batch = _batch(poller, 4, committed_at=dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC))
    (plain,) = pack_batch(batch, 256 * 1024)
    (stamped,) = _send(poller, batch)
    # Then the message id (duplicate detection) is unchanged; the new fields round-trip
    assert stamped.message_id == plain.message_id and stamped.event_ids == plain.event_ids
    decoded = decode_batch(stamped.body)
    assert decoded.read_at is not None and decoded.traceparent is not None
    assert decoded.events[0].committed_at == dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC)
    # And a body without them (an older poller's) decodes as before
    old = decode_batch(encode_batch(replace(batch, events=tuple(replace(e, committed_at=None) for e in batch.events))))
    assert old.read_at is None and old.traceparent is None and old.events[0].committed_at is None
    assert old == decoded  # telemetry fields are not part of a batch's identity


def test_a_failed_delivery_span_records_the_scrubbed_exception() -> None:
    poller = _poller_name()
    (message,) = _send(poller, _batch(poller, 1))

    def leaky(events: list[RowChange], context: HandlerContext) -> None:
        raise RuntimeError(f"AccountKey={SECRET};EndpointSuffix=core.windows.net")

    with pytest.raises(Exception, match="AccountKey=\\*\\*\\*"):
        _worker(poller, leaky).process(_delivery(message))
    (deliver,) = otel.spans("dbfanout.deliver")
    assert deliver.status.status_code is StatusCode.ERROR
    (event,) = [e for e in deliver.events if e.name == "exception"]
    texts = " ".join(str(v) for v in (event.attributes or {}).values()) + str(deliver.status.description)
    assert "HandlerError" in texts and "AccountKey=***" in texts and SECRET not in texts


AGO = object()  # the event's commit time: 30, 31 or 32 s before the test runs, two events each


@pytest.mark.parametrize(
    ("kind", "changes", "field", "label"),
    [
        ("pg_logical", {"kind": "pg_logical"}, "committed_at", "pg_commit"),
        ("mysql_binlog", {"kind": "mysql_binlog"}, "committed_at", "binlog_commit"),
        ("outbox", {"kind": "outbox"}, "committed_at", "outbox_created"),
        ("cursor", {"cursor_is_commit_time": True}, "cursor", "cursor"),
        ("read", {}, None, "read"),
    ],
)
def test_commit_to_handler_gets_one_observation_per_commit_from_the_best_known_commit_time(
    kind: str, changes: dict[str, object], field: str | None, label: str
) -> None:
    # Given a 6-event message from three commits, two events each, whose commit time comes from the
    # source, the cursor or (unknown: one time for the whole message) the poller's read
    now = dt.datetime.now(dt.UTC)  # taken now: parametrize values are built when the suite is collected
    poller = _poller_name()
    batch = _batch(poller, 6)
    if field is not None:
        times: list[dict[str, Any]] = [{field: now - dt.timedelta(seconds=30 + i // 2)} for i in range(6)]
        events = tuple(replace(e, **t) for e, t in zip(batch.events, times, strict=True))
        batch = replace(batch, events=events)
    (message,) = _send(poller, batch)
    # When the worker handles it
    _worker(poller, Handler(), **changes).process(_delivery(message))
    # Then one observation per commit (one for the read), labelled with where the time came from, as old as it
    found = [p for attrs, p in otel.points().get("dbfanout.commit_to_handler", []) if attrs.get("poller") == poller]
    assert [p.count for p in found] == [1 if field is None else 3]
    (attrs,) = [a for a, _ in otel.points()["dbfanout.commit_to_handler"] if a.get("poller") == poller]
    assert attrs == {"poller": poller, "queue": "orders-changes", "commit_time": label}
    if field is not None:
        assert 30.0 <= found[0].min < 31.0 and 32.0 <= found[0].max < 60.0
    # And the events are counted where events are counted
    assert otel.total("dbfanout.events_handled", poller=poller) == 6


def test_events_without_a_known_commit_time_add_one_read_time_observation_beside_the_commits() -> None:
    # Given an outbox message (commit time known) whose last event, from an older writer, has none
    now = dt.datetime.now(dt.UTC)
    poller = _poller_name()
    batch = _batch(poller, 3)
    events = (replace(batch.events[0], committed_at=now - dt.timedelta(seconds=40)), *batch.events[1:])
    (message,) = _send(poller, replace(batch, events=events))
    # When the worker handles it
    _worker(poller, Handler(), kind="outbox").process(_delivery(message))
    # Then one observation from the outbox row's time and one from the poller's read
    points = {
        a["commit_time"]: p for a, p in otel.points().get("dbfanout.commit_to_handler", []) if a["poller"] == poller
    }
    assert sorted(points) == ["outbox_created", "read"]
    assert points["outbox_created"].count == 1 and points["outbox_created"].min >= 40.0
    assert points["read"].count == 1 and points["read"].max < 30.0


def test_a_poisoned_event_counts_dead_lettered_once_and_each_failed_delivery() -> None:
    # Given a 3-event message with one poison row (MaxDeliveryCount 10, split on its 2nd failed delivery)
    poller = _poller_name()
    (message,) = _send(poller, _batch(poller, 3))
    sent = Sent()
    config = Config(AppConfig("app"), {poller: replace(make_poller(max_delivery_count=10), name=poller)})
    handler = Handler(poison={f"ev-{poller}-1"})
    worker = Worker(config, splitter=Splitter(config, sent), handlers={poller: handler})
    # When it fails, fails again and is split, and the poison single fails all its 10 deliveries
    with pytest.raises(Exception, match="handler"):
        worker.process(_delivery(message, count=1))
    worker.process(_delivery(message, count=2))  # split: the singles go out
    singles = {m.event_ids[0]: m for _, batch in sent.messages for m in batch}
    for single in singles.values():
        for count in range(1, 11):
            try:
                worker.process(_delivery(single, count=count))
                break
            except Exception:
                continue
    # Then one dead-lettered event; failed deliveries: 2 (the batch) + 10 (the poison single); one split
    assert otel.total("dbfanout.events.dead_lettered", poller=poller) == 1
    assert otel.total("dbfanout.deliveries.failed", poller=poller) == 12
    assert otel.total("dbfanout.messages_split", poller=poller) == 1
    assert otel.total("dbfanout.events_handled", poller=poller) == 2
    # And the singles continue the trace of the delivery that split them
    split_span = [
        s
        for s in otel.spans("dbfanout.deliver")
        if (dict(s.attributes or {})["dbfanout.delivery_count"], dict(s.attributes or {})["dbfanout.events"]) == (2, 3)
    ]
    assert len(split_span) == 1
    tp = singles[f"ev-{poller}-1"].application_properties[PROP_TRACEPARENT]
    assert tp == _traceparent(split_span[0])
