"""The worker runtime: one received message in, the user handler called, settlement decided.

Used by the queue-triggered functions of ``function_app.py`` and usable from any Service Bus
consumer. Raising from :meth:`Worker.process` means "fail the message" (abandon → retry →
dead-letter after MaxDeliveryCount); returning means "complete it".
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.codec import decode_batch
from shared.config import Config
from shared.errors import ConfigError, EnvelopeError, HandlerError
from shared.logs import get_logger, ids
from shared.models import Batch, HandlerContext, RowChange
from shared.telemetry import metrics
from worker.handlers import Handler, call_handler, load_handler
from worker.settlement import Settle, decide
from worker.split import Splitter

__all__ = ["Delivery", "Worker"]

log = get_logger("worker")


@dataclass(frozen=True, slots=True)
class Delivery:
    """What the worker needs of a received message (filled from a Functions or SDK message)."""

    body: bytes
    message_id: str
    delivery_count: int  # Functions semantics: 1 on the first delivery
    enqueued_time: dt.datetime | None = None
    application_properties: Mapping[str, Any] = field(default_factory=dict)


class Worker:
    """Decodes batches and dispatches them to the handler configured for their poller."""

    def __init__(
        self,
        config: Config,
        *,
        splitter: Splitter | None = None,
        handlers: Mapping[str, Handler] | None = None,
        app_root: Path | None = None,
        resolve_claims: Callable[[RowChange], RowChange] | None = None,
    ) -> None:
        self._config = config
        self._splitter = splitter
        self._handlers: dict[str, Handler] = dict(handlers or {})
        self._app_root = app_root
        self._resolve_claims = resolve_claims

    def handler_for(self, poller: str) -> Handler:
        if poller not in self._handlers:
            cfg = self._config.pollers.get(poller)
            if cfg is None:
                raise EnvelopeError(f"message is for poller {poller!r}, which this app does not configure")
            if cfg.handler is None:
                raise ConfigError(f"pollers.{poller}.handler", "no handler configured for this poller")
            self._handlers[poller] = load_handler(cfg.handler, key=f"pollers.{poller}.handler", app_root=self._app_root)
        return self._handlers[poller]

    def process(self, delivery: Delivery) -> Settle:
        """Handle one message. Returns COMPLETE or SPLIT (both: complete it); raises to fail it."""
        try:
            batch = decode_batch(delivery.body)
        except EnvelopeError:
            log.error(
                "malformed message; it will reach the dead-letter queue",
                extra=ids(message_id=delivery.message_id, delivery_count=delivery.delivery_count),
                exc_info=True,
            )
            metrics.failures.add(1, {"stage": "decode"})
            raise
        context = HandlerContext(
            poller=batch.poller,
            message_id=delivery.message_id,
            delivery_count=delivery.delivery_count,
            enqueued_time=delivery.enqueued_time,
            batch_id=batch.batch_id,
            application_properties=dict(delivery.application_properties),
        )
        try:
            handler = self.handler_for(batch.poller)
        except (ConfigError, EnvelopeError):
            log.error(
                "no handler for this message; it will reach the dead-letter queue",
                extra=ids(poller=batch.poller, batch_id=batch.batch_id, message_id=delivery.message_id),
                exc_info=True,
            )
            metrics.failures.add(1, {"stage": "handler-load", "poller": batch.poller})
            raise
        started = time.perf_counter()
        try:
            # Claim-check references are resolved here, inside the failure path: a missing claim
            # fails this message like a handler error (retried, split, its single dead-lettered).
            call_handler(handler, self._events(batch), context)
            error: Exception | None = None
        except Exception as exc:  # the user's code may raise anything; it fails the message
            error = exc
        metrics.handler_duration.record(time.perf_counter() - started, {"poller": batch.poller})
        cfg = self._config.pollers[batch.poller]
        n_events = len(batch.events)
        outcome = decide(error is None, n_events, delivery.delivery_count, cfg.split_after_deliveries, cfg.deliveries)
        return self._carry_out(outcome, batch, delivery, error)

    def _events(self, batch: Batch) -> list[RowChange]:
        events = list(batch.events)
        return [self._resolve_claims(e) for e in events] if self._resolve_claims else events

    def _carry_out(self, outcome: Settle, batch: Batch, delivery: Delivery, error: Exception | None) -> Settle:
        keys = ids(
            poller=batch.poller,
            batch_id=batch.batch_id,
            message_id=delivery.message_id,
            delivery_count=delivery.delivery_count,
            events=len(batch.events),
        )
        if outcome is Settle.COMPLETE:
            metrics.events_handled.add(len(batch.events), {"poller": batch.poller})
            return outcome
        if outcome is Settle.SPLIT and self._splitter is not None:
            # The error is logged before the singles go: if the split fails, the cause is on record.
            log.warning(
                "handler failed on a multi-event message; splitting it into single events",
                extra={**keys, "error": repr(error)},
                exc_info=error,
            )
            # Singles first, parent completes after: a crash between them re-splits with the same ids.
            self._splitter.split(
                batch, parent_message_id=delivery.message_id, queue=self._config.pollers[batch.poller].queue
            )
            metrics.messages_split.add(1, {"poller": batch.poller})
            return outcome
        log.warning(
            "handler failed; the message will be retried, then dead-lettered",
            extra={**keys, "error": repr(error)},
            exc_info=error,
        )
        metrics.failures.add(1, {"stage": "handler", "poller": batch.poller})
        raise HandlerError(
            f"handler for poller {batch.poller} failed on message {delivery.message_id} "
            f"(delivery {delivery.delivery_count}): {error!r}"
        ) from error
