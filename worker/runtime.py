"""The worker runtime: one received message in, the user handler called, settlement decided.

Used by the queue-triggered functions of ``function_app.py`` and usable from any Service Bus
consumer. Raising from :meth:`Worker.process` means "fail the message" (abandon → retry →
dead-letter after MaxDeliveryCount); returning means "complete it".

A topic poller's messages are processed per subscription (``process(delivery, subscription)``):
the subscription's handler runs, its MaxDeliveryCount decides when to split, and the singles go
back to the topic for that subscription alone.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shared.claimcheck import is_claim
from shared.codec import decode_batch
from shared.config import Config
from shared.errors import ConfigError, EnvelopeError, HandlerError
from shared.failures import FailureRecord
from shared.logs import get_logger, ids
from shared.models import Batch, HandlerContext, RowChange
from shared.scrub import describe_error, safe_cause
from shared.telemetry import metrics, recording
from shared.tracing import delivery_span, messaging_system
from worker.handlers import Handler, call_handler, load_handler
from worker.settlement import Settle, decide, split_first
from worker.split import Splitter

__all__ = ["Delivery", "FailureRecorder", "HandlerKey", "Worker", "entity_of"]

log = get_logger("worker")

#: Handlers are cached per poller and subscription (None for a queue poller).
HandlerKey = tuple[str, str | None]


@dataclass(frozen=True, slots=True)
class Delivery:
    """What the worker needs of a received message (filled from a Functions or SDK message)."""

    body: bytes
    message_id: str
    delivery_count: int  # Functions semantics: 1 on the first delivery
    enqueued_time: dt.datetime | None = None
    application_properties: Mapping[str, Any] = field(default_factory=dict)


class Worker:
    """Decodes batches and dispatches them to the handler configured for their poller (or for the
    topic subscription they were received on)."""

    def __init__(
        self,
        config: Config,
        *,
        splitter: Splitter | None = None,
        handlers: Mapping[str, Handler] | Mapping[HandlerKey, Handler] | None = None,
        app_root: Path | None = None,
        resolve_claims: Callable[[RowChange], RowChange] | None = None,
        failures: FailureRecorder | None = None,
    ) -> None:
        """``handlers`` replace configured ones: by poller name, or by ``(poller, subscription)``.
        ``failures``: where each failed delivery leaves its reason for ``dbfanout dlq`` (shared.failures)."""
        self._config = config
        self._splitter = splitter
        self._handlers: dict[HandlerKey, Handler] = {
            (key if isinstance(key, tuple) else (key, None)): h for key, h in (handlers or {}).items()
        }
        self._app_root = app_root
        self._resolve_claims = resolve_claims
        self._failures = failures

    def handler_for(self, poller: str, subscription: str | None = None) -> Handler:
        """The handler of ``poller`` (queue pollers) or of its ``subscription`` (topic pollers), cached."""
        key = (poller, subscription)
        if key not in self._handlers:
            spec, where = self._handler_spec(poller, subscription)
            self._handlers[key] = load_handler(spec, key=where, app_root=self._app_root)
        return self._handlers[key]

    def _handler_spec(self, poller: str, subscription: str | None) -> tuple[str, str]:
        """``(module:function, the TOML key naming it)`` for a message of ``poller`` received here."""
        cfg = self._config.pollers.get(poller)
        if cfg is None:
            raise EnvelopeError(f"message is for poller {poller!r}, which this app does not configure")
        if subscription is not None:
            if not cfg.is_topic:
                raise EnvelopeError(
                    f"message of poller {poller!r} arrived on subscription {subscription!r}, "
                    f"but that poller sends to queue {cfg.queue}, not to a topic"
                )
            return cfg.subscription(subscription).handler, f"pollers.{poller}.subscriptions.{subscription}.handler"
        if cfg.is_topic:
            raise ConfigError(
                f"pollers.{poller}.subscriptions",
                f"a message of topic poller {poller} was received without its subscription",
                hint="receive it from one of the topic's subscriptions and pass that subscription to the worker",
            )
        if cfg.handler is None:
            raise ConfigError(f"pollers.{poller}.handler", "no handler configured for this poller")
        return cfg.handler, f"pollers.{poller}.handler"

    def process(self, delivery: Delivery, subscription: str | None = None) -> Settle:
        """Handle one message. Returns COMPLETE or SPLIT (both: complete it); raises to fail it.

        ``subscription``: the topic subscription it was received on (None: a queue).
        """
        batch = self._decode(delivery)
        cfg = self._config.pollers.get(batch.poller)
        span_attributes = {
            "messaging.system": messaging_system(cfg.transport if cfg is not None else "servicebus"),
            "messaging.operation": "process",
            "messaging.destination.name": cfg.queue if cfg is not None else None,
            "messaging.message.id": delivery.message_id,
            "dbfanout.poller": batch.poller,
            "dbfanout.subscription": subscription,
            "dbfanout.batch_id": batch.batch_id,
            "dbfanout.delivery_count": delivery.delivery_count,
            "dbfanout.events": len(batch.events),
        }
        with delivery_span(delivery.application_properties, batch.traceparent, span_attributes):
            return self._process(batch, delivery, subscription)

    def _process(self, batch: Batch, delivery: Delivery, subscription: str | None) -> Settle:
        handler = self._handler(batch, delivery, subscription)
        cfg = self._config.pollers[batch.poller]
        deliveries = cfg.deliveries_for(subscription)  # each subscription has its own MaxDeliveryCount
        if self._splitter is not None and split_first(len(batch.events), delivery.delivery_count, deliveries):
            return self._split_first(batch, delivery, subscription, deliveries)
        context = HandlerContext(
            poller=batch.poller,
            message_id=delivery.message_id,
            delivery_count=delivery.delivery_count,
            enqueued_time=delivery.enqueued_time,
            batch_id=batch.batch_id,
            application_properties=dict(delivery.application_properties),
            subscription=subscription,
        )
        started = time.perf_counter()
        try:
            # Claim-check references are resolved here, inside the failure path: a missing claim
            # fails this message like a handler error (retried, split, its single dead-lettered).
            call_handler(handler, self._events(batch), context)
            error: Exception | None = None
        except Exception as exc:  # the user's code may raise anything; it fails the message
            error = exc
        metrics.handler_duration.record(time.perf_counter() - started, self._attrs(batch.poller, subscription))
        n_events = len(batch.events)
        outcome = decide(error is None, n_events, delivery.delivery_count, cfg.split_after_deliveries, deliveries)
        return self._carry_out(outcome, batch, delivery, error, subscription)

    def _split_first(self, batch: Batch, delivery: Delivery, subscription: str | None, deliveries: int) -> Settle:
        """Split a redelivered batch close to quarantine without running its handler (settlement.split_first)."""
        log.warning(
            "multi-event message redelivered close to its MaxDeliveryCount; splitting it before its handler runs",
            extra=ids(
                poller=batch.poller,
                subscription=subscription,
                batch_id=batch.batch_id,
                message_id=delivery.message_id,
                delivery_count=delivery.delivery_count,
                max_delivery_count=deliveries,
                events=len(batch.events),
            ),
        )
        self._split(batch, delivery, subscription)
        return Settle.SPLIT

    def _split(self, batch: Batch, delivery: Delivery, subscription: str | None) -> None:
        """Send the batch's singles (then the caller lets the parent complete).

        Singles first, parent completes after: a crash between them re-splits with the same ids.
        A topic poller's singles go to its topic, addressed to this subscription only.
        """
        assert self._splitter is not None
        self._splitter.split(
            batch,
            parent_message_id=delivery.message_id,
            queue=self._config.pollers[batch.poller].queue,
            subscription=subscription,
        )
        metrics.messages_split.add(1, self._attrs(batch.poller, subscription))

    def _decode(self, delivery: Delivery) -> Batch:
        try:
            return decode_batch(delivery.body)
        except EnvelopeError:
            log.error(
                "malformed message; it will reach the dead-letter queue",
                extra=ids(message_id=delivery.message_id, delivery_count=delivery.delivery_count),
                exc_info=True,
            )
            metrics.failures.add(1, {"stage": "decode"})
            raise

    def _handler(self, batch: Batch, delivery: Delivery, subscription: str | None) -> Handler:
        try:
            return self.handler_for(batch.poller, subscription)
        except (ConfigError, EnvelopeError):
            keys = ids(
                poller=batch.poller, subscription=subscription, batch_id=batch.batch_id, message_id=delivery.message_id
            )
            log.error("no handler for this message; it will reach the dead-letter queue", extra=keys, exc_info=True)
            metrics.failures.add(1, {"stage": "handler-load", "poller": batch.poller})
            raise

    def _events(self, batch: Batch) -> list[RowChange]:
        events = list(batch.events)
        resolve = self._resolve_claims
        if resolve is None or not any(map(is_claim, events)):
            return events  # the common case: no reference to swap, no call per event
        return [resolve(e) if is_claim(e) else e for e in events]

    def _carry_out(
        self, outcome: Settle, batch: Batch, delivery: Delivery, error: Exception | None, subscription: str | None
    ) -> Settle:
        keys = ids(
            poller=batch.poller,
            subscription=subscription,
            batch_id=batch.batch_id,
            message_id=delivery.message_id,
            delivery_count=delivery.delivery_count,
            events=len(batch.events),
        )
        attrs = self._attrs(batch.poller, subscription)
        if outcome is Settle.COMPLETE:
            metrics.events_handled.add(len(batch.events), attrs)
            if recording():  # one observation per commit: skipped without a metrics SDK
                self._observe_latency(batch, delivery, attrs)
            if delivery.delivery_count > 1:  # an earlier delivery may have left a failure record
                self._clear_failure(batch, delivery, subscription)
            return outcome
        metrics.deliveries_failed.add(1, attrs)
        if outcome is Settle.SPLIT and self._splitter is not None:
            # The error is logged before the singles go: if the split fails, the cause is on record.
            log.warning(
                "handler failed on a multi-event message; splitting it into single events",
                extra={**keys, "error": repr(error)},
                exc_info=error,
            )
            self._split(batch, delivery, subscription)
            return outcome
        log.warning(
            "handler failed; the message will be retried, then dead-lettered",
            extra={**keys, "error": repr(error)},
            exc_info=error,
        )
        metrics.failures.add(1, {"stage": "handler", "poller": batch.poller})
        cfg = self._config.pollers[batch.poller]
        if delivery.delivery_count >= cfg.deliveries_for(subscription):  # the last: the broker quarantines it
            metrics.events_dead_lettered.add(len(batch.events), attrs)
        assert error is not None
        self._record_failure(batch, delivery, subscription, error)  # before raising: it may be the last
        where = f"poller {batch.poller}" + (f" subscription {subscription}" if subscription else "")
        # The host logs this text on every failed delivery: scrubbed, and when the original text held
        # a secret, without the original chained under it (its traceback is in the log line above).
        raise HandlerError(
            f"handler for {where} failed on message {delivery.message_id} "
            f"(delivery {delivery.delivery_count}): {describe_error(error)}"
        ) from safe_cause(error)

    def _attrs(self, poller: str, subscription: str | None) -> dict[str, str]:
        """Metric attributes: the poller, and where the worker received the message."""
        cfg = self._config.pollers.get(poller)
        attrs = {"poller": poller}
        if cfg is not None:
            attrs["queue"] = cfg.queue
        if subscription is not None:
            attrs["subscription"] = subscription
        return attrs

    def _observe_latency(self, batch: Batch, delivery: Delivery, attrs: dict[str, str]) -> None:
        """``dbfanout.commit_to_handler``: one observation per source commit the delivery carried.

        The events of one commit (a pg_logical transaction, the rows one read fetched) share their
        commit time, so they reached the handler equally late: one observation stands for them all,
        and ``dbfanout.events_handled`` counts the events. One per event would cost the Python SDK
        about 3 µs each, a fifth of a no-op handler's whole cost per row (BENCHMARKS.md).
        """
        cfg = self._config.pollers[batch.poller]
        now = time.time()
        source_kind = _COMMIT_KIND.get(cfg.kind, "source")
        cursor_is_commit_time = cfg.cursor_is_commit_time
        zone = _zone(cfg.cursor_timezone) if cursor_is_commit_time else dt.UTC  # once, not per event
        commits: dict[tuple[dt.datetime, str], None] = {}  # distinct (commit time, where it came from)
        unknown = False  # an event whose commit time the source does not know
        for event in batch.events:
            if event.committed_at is not None:
                commits[event.committed_at, source_kind] = None
            elif cursor_is_commit_time and isinstance(event.cursor, dt.datetime):
                cursor = event.cursor
                commits[cursor if cursor.tzinfo else cursor.replace(tzinfo=zone), "cursor"] = None
            else:
                unknown = True
        if unknown:  # the poller's read (or the broker's enqueue): one time for the whole message
            when = batch.read_at if batch.read_at is not None else delivery.enqueued_time
            if when is not None:
                commits[when, "read" if batch.read_at is not None else "enqueued"] = None
        record = metrics.commit_to_handler.record
        for when, kind in commits:
            record(max(0.0, now - when.timestamp()), {**attrs, "commit_time": kind})

    def _record_failure(self, batch: Batch, delivery: Delivery, subscription: str | None, error: Exception) -> None:
        """Leave this failure where ``dbfanout dlq`` finds it; never fails the delivery further."""
        if self._failures is None:
            return
        cfg = self._config.pollers[batch.poller]
        record = FailureRecord(
            entity=entity_of(cfg.queue, subscription),
            poller=batch.poller,
            message_id=delivery.message_id,
            delivery_count=delivery.delivery_count,
            failed_at=dt.datetime.now(dt.UTC).isoformat(),
            error_type=type(error).__name__,
            error=describe_error(error),
            event_ids=tuple(e.event_id for e in batch.events),
            subscription=subscription,
            dead_lettered=delivery.delivery_count >= cfg.deliveries_for(subscription),
        )
        try:
            self._failures.record(record, delivery.body)
        except Exception as exc:  # the reason is also in the log line; the delivery fails either way
            log.warning(
                "could not write the failure record; `dbfanout dlq peek` will not show this reason",
                extra=ids(poller=batch.poller, message_id=delivery.message_id, error=repr(exc)),
            )

    def _clear_failure(self, batch: Batch, delivery: Delivery, subscription: str | None) -> None:
        if self._failures is None:
            return
        try:
            self._failures.clear(entity_of(self._config.pollers[batch.poller].queue, subscription), delivery.body)
        except Exception as exc:  # a stale record is harmless: the lifecycle rule expires it
            log.debug("could not delete a failure record", extra=ids(message_id=delivery.message_id, error=repr(exc)))


#: How the commit time of a change-log source's events is labelled (``commit_time`` attribute).
_COMMIT_KIND = {"pg_logical": "pg_commit", "mysql_binlog": "binlog_commit", "outbox": "outbox_created"}


def _zone(name: str | None) -> dt.tzinfo:
    """A naive temporal cursor's time zone (``cursor_timezone``), UTC when none is configured."""
    if name is None:
        return dt.UTC
    from zoneinfo import ZoneInfo

    return ZoneInfo(name)


class FailureRecorder(Protocol):
    """Where failed deliveries leave their reason (:class:`shared.failures.FailureStore`)."""

    def record(self, record: FailureRecord, body: bytes) -> None: ...
    def clear(self, entity: str, body: bytes) -> None: ...


def entity_of(queue: str, subscription: str | None) -> str:
    """The entity a message was received on, as operators name it: ``queue`` or ``topic/subscription``."""
    return f"{queue}/{subscription}" if subscription is not None else queue
