"""The worker runtime: one received message in, the user handler called, settlement decided.

Used by the queue-triggered functions of ``function_app.py`` and usable from any Service Bus
consumer. Raising from :meth:`Worker.process` means "fail the message" (abandon → retry →
dead-letter after MaxDeliveryCount); returning means "complete it".

A topic poller's messages are processed per subscription (``process(delivery, subscription)``):
the subscription's handler runs, its MaxDeliveryCount decides when to split, and the singles go
back to the topic for that subscription alone.

What only observes a delivery (logs, metrics, the trace span, failure records) is a hook
(:mod:`worker.hooks`), called before and after each step; the runtime decides and settles.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path

from shared.claimcheck import is_claim
from shared.codec import decode_batch
from shared.config import Config
from shared.errors import ConfigError, EnvelopeError, HandlerError
from shared.logs import get_logger, ids
from shared.models import Batch, HandlerContext, RowChange
from shared.scrub import describe_error, safe_cause
from worker.delivery import Delivery, DeliveryInfo, delivery_info
from worker.delivery_log import DeliveryLog
from worker.failure_records import FailureRecorder, FailureRecords, entity_of
from worker.handlers import Handler, call_handler, load_handler
from worker.hooks import Hook
from worker.metrics import Metrics
from worker.settlement import Settle, decide, split_first
from worker.split import Splitter
from worker.tracing import Tracing

__all__ = ["Delivery", "FailureRecorder", "HandlerKey", "Hook", "Worker", "default_hooks", "entity_of"]

log = get_logger("worker")

#: Handlers are cached per poller and subscription (None for a queue poller).
HandlerKey = tuple[str, str | None]


def default_hooks(failures: FailureRecorder | None = None) -> list[Hook]:
    """The worker's own hooks: its log lines, metrics, trace span and (given a recorder) failure records."""
    hooks: list[Hook] = [DeliveryLog(), Metrics(), Tracing()]
    if failures is not None:
        hooks.append(FailureRecords(failures))
    return hooks


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
        hooks: Sequence[Hook] = (),
    ) -> None:
        """``handlers`` replace configured ones: by poller name, or by ``(poller, subscription)``.
        ``failures``: where each failed delivery leaves its reason for ``dbfanout dlq`` (shared.failures).
        ``hooks``: called after the worker's own (:func:`default_hooks`) at each point of a delivery."""
        self._config = config
        self._splitter = splitter
        self._handlers: dict[HandlerKey, Handler] = {
            (key if isinstance(key, tuple) else (key, None)): h for key, h in (handlers or {}).items()
        }
        self._app_root = app_root
        self._resolve_claims = resolve_claims
        self._hooks: list[Hook] = [*default_hooks(failures), *hooks]

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
        info = delivery_info(batch, delivery, subscription, self._config.pollers.get(batch.poller))
        with ExitStack() as around:
            for hook in self._hooks:
                around.enter_context(hook.delivery(info))
            return self._process(info)

    def _process(self, info: DeliveryInfo) -> Settle:
        handler = self._handler(info)
        batch, delivery = info.batch, info.delivery
        assert info.poller is not None  # the handler loaded: the poller is configured
        if self._splitter is not None and split_first(len(batch.events), delivery.delivery_count, info.deliveries):
            return self._split(info, None)
        started = time.perf_counter()
        try:
            # Claim-check references are resolved here, inside the failure path: a missing claim
            # fails this message like a handler error (retried, split, its single dead-lettered).
            call_handler(handler, self._events(batch), self._context(info))
            error: Exception | None = None
        except Exception as exc:  # the user's code may raise anything; it fails the message
            error = exc
        self._call("after_handler", info, time.perf_counter() - started, error)
        split_after = info.poller.split_after_deliveries
        outcome = decide(error is None, len(batch.events), delivery.delivery_count, split_after, info.deliveries)
        if outcome is Settle.SPLIT and self._splitter is not None:
            return self._split(info, error)
        if outcome is Settle.SPLIT:  # no splitter: the message fails as a whole
            outcome = Settle.RAISE
        self._call("after_delivery", info, outcome, error)
        if error is not None:
            raise _handler_error(info, error)
        return outcome

    def _split(self, info: DeliveryInfo, error: Exception | None) -> Settle:
        """Send the batch's singles (then the caller lets the parent complete); ``error`` None: the
        batch is split before its handler runs, close to quarantine (settlement.split_first).

        Singles first, parent completes after: a crash between them re-splits with the same ids.
        A topic poller's singles go to its topic, addressed to this subscription only.
        """
        assert self._splitter is not None and info.poller is not None
        self._call("before_split", info, error)
        self._splitter.split(
            info.batch,
            parent_message_id=info.delivery.message_id,
            queue=info.poller.queue,
            subscription=info.subscription,
        )
        self._call("after_split", info)
        self._call("after_delivery", info, Settle.SPLIT, error)
        return Settle.SPLIT

    def _call(self, point: str, *args: object) -> None:
        for hook in self._hooks:
            getattr(hook, point)(*args)

    @staticmethod
    def _context(info: DeliveryInfo) -> HandlerContext:
        delivery = info.delivery
        return HandlerContext(
            poller=info.batch.poller,
            message_id=delivery.message_id,
            delivery_count=delivery.delivery_count,
            enqueued_time=delivery.enqueued_time,
            batch_id=info.batch.batch_id,
            application_properties=dict(delivery.application_properties),
            subscription=info.subscription,
        )

    def _decode(self, delivery: Delivery) -> Batch:
        try:
            return decode_batch(delivery.body)
        except EnvelopeError:
            log.error(
                "malformed message; it will reach the dead-letter queue",
                extra=ids(message_id=delivery.message_id, delivery_count=delivery.delivery_count),
                exc_info=True,
            )
            for hook in self._hooks:
                hook.rejected("decode", delivery, None)
            raise

    def _handler(self, info: DeliveryInfo) -> Handler:
        try:
            return self.handler_for(info.batch.poller, info.subscription)
        except (ConfigError, EnvelopeError):
            keys = ids(
                poller=info.batch.poller,
                subscription=info.subscription,
                batch_id=info.batch.batch_id,
                message_id=info.delivery.message_id,
            )
            log.error("no handler for this message; it will reach the dead-letter queue", extra=keys, exc_info=True)
            for hook in self._hooks:
                hook.rejected("handler-load", info.delivery, info)
            raise

    def _events(self, batch: Batch) -> list[RowChange]:
        events = list(batch.events)
        resolve = self._resolve_claims
        if resolve is None or not any(map(is_claim, events)):
            return events  # the common case: no reference to swap, no call per event
        return [resolve(e) if is_claim(e) else e for e in events]


def _handler_error(info: DeliveryInfo, error: Exception) -> HandlerError:
    """What fails the delivery: the host logs this text on every failed delivery, so it is scrubbed,
    and when the original text held a secret the original is not chained under it (its traceback is
    in the hook's log line)."""
    where = f"poller {info.batch.poller}" + (f" subscription {info.subscription}" if info.subscription else "")
    delivery = info.delivery
    exc = HandlerError(
        f"handler for {where} failed on message {delivery.message_id} "
        f"(delivery {delivery.delivery_count}): {describe_error(error)}"
    )
    exc.__cause__ = safe_cause(error)
    return exc
