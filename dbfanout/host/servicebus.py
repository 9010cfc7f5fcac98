"""Service Bus queue and topic-subscription triggers: one peek-lock receiver per function,
settled like autoComplete.

One pump thread owns the receiver and does every AMQP operation on it - receive, complete,
abandon, renew - because SDK handlers are not thread-safe. User functions run on a thread pool
of ``maxConcurrentCalls`` workers and hand their outcome back to the pump. Success completes
the message, an exception abandons it (Service Bus counts the delivery and dead-letters at the
queue's or the subscription's MaxDeliveryCount), through :func:`worker.settlement.settle_bus`.
While a single-message function runs, the pump renews its lock up to
``maxAutoLockRenewalDuration`` (the host does not renew for ``cardinality="many"``).
"""

from __future__ import annotations

import datetime as dt
import queue
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from azure.servicebus import ServiceBusClient, ServiceBusReceivedMessage, ServiceBusReceiver
from azure.servicebus.exceptions import ServiceBusError

from dbfanout.host.app_loader import FunctionSpec
from dbfanout.host.batch_receive import receive_batch, receiver_options
from dbfanout.host.hostjson import ServiceBusOptions
from dbfanout.host.invoke import invoke
from dbfanout.host.messages import to_functions_message
from dbfanout.host.runner import TriggerRunner
from dbfanout.host.schedule import resolve_setting
from shared.errors import ConfigError
from shared.logs import get_logger, ids
from shared.servicebus import servicebus_client
from shared.settings import ServiceBusConnection, servicebus_connection
from worker.settlement import settle_bus

__all__ = ["QueueRunner", "ServiceBusTrigger", "call_with_messages"]

log = get_logger("host.servicebus")


@dataclass(frozen=True)
class ServiceBusTrigger:
    """What a ``serviceBusTrigger`` binding asks for: a queue, or a topic and one of its
    subscriptions; connection, cardinality, sessions.

    ``queue`` is the entity the trigger receives from: the queue, or ``topic/Subscriptions/sub``.
    """

    queue: str
    connection_name: str
    connection: ServiceBusConnection
    many: bool
    sessions: bool
    topic: str | None = None
    subscription: str | None = None

    @classmethod
    def of(cls, spec: FunctionSpec, settings: Mapping[str, str]) -> ServiceBusTrigger:
        trigger = spec.trigger
        name = str(trigger.get("connection") or "AzureWebJobsServiceBus")
        topic, subscription = _topic_and_subscription(spec, settings)
        queue = (
            f"{topic}/Subscriptions/{subscription}"
            if topic is not None
            else resolve_setting(str(trigger.get("queueName", "")), settings, f"{spec.name}.queueName")
        )
        return cls(
            queue=queue,
            connection_name=name,
            connection=servicebus_connection(settings, name),
            many=str(trigger.get("cardinality", "ONE")).upper() == "MANY",
            sessions=bool(trigger.get("isSessionsEnabled")),
            topic=topic,
            subscription=subscription,
        )

    def receiver(self, client: ServiceBusClient, **kwargs: Any) -> ServiceBusReceiver:
        """A receiver on the queue, or on the topic's subscription (``kwargs``: session id, waits)."""
        if self.topic is not None and self.subscription is not None:
            return client.get_subscription_receiver(self.topic, self.subscription, **kwargs)
        return client.get_queue_receiver(self.queue, **kwargs)


def _topic_and_subscription(spec: FunctionSpec, settings: Mapping[str, str]) -> tuple[str | None, str | None]:
    """``(topicName, subscriptionName)`` of a subscription trigger (``%SETTING%`` resolved); Nones for a queue."""
    topic, subscription = spec.trigger.get("topicName"), spec.trigger.get("subscriptionName")
    if not topic and not subscription:
        return None, None
    if not topic or not subscription:
        missing = "subscriptionName" if topic else "topicName"
        raise ConfigError(f"{spec.name}.{missing}", "a topic trigger names both topicName and subscriptionName")
    return (
        resolve_setting(str(topic), settings, f"{spec.name}.topicName"),
        resolve_setting(str(subscription), settings, f"{spec.name}.subscriptionName"),
    )


def call_with_messages(spec: FunctionSpec, messages: list[ServiceBusReceivedMessage], many: bool) -> None:
    """Call the function with the messages as the host binds them (a list for ``cardinality="many"``)."""
    converted = [to_functions_message(m) for m in messages]
    invoke(spec, converted if many else converted[0])


@dataclass(eq=False)
class _Invocation:
    messages: list[ServiceBusReceivedMessage]
    started: float = field(default_factory=time.monotonic)
    lock_span: float = 0.0
    error: BaseException | None = None
    renew: bool = True


class QueueRunner(TriggerRunner[_Invocation]):
    """Feeds one queue- (or subscription-) triggered function until stopped."""

    _idle_wait = 1.0  # how long a receive waits when no call runs
    _busy_wait = 0.1  # ... and while calls run, so finished ones are settled soon

    def __init__(self, spec: FunctionSpec, settings: Mapping[str, str], options: ServiceBusOptions) -> None:
        self.trigger = trigger = ServiceBusTrigger.of(spec, settings)
        if trigger.sessions:
            raise ConfigError(
                f"{spec.name}.isSessionsEnabled",
                "a session-enabled trigger is served by SessionQueueRunner (dbfanout.host.sessions)",
            )
        super().__init__(spec, trigger.queue, options.max_concurrent_calls)
        self.connection_name = trigger.connection_name
        self._connection = trigger.connection
        self.many = trigger.many
        self.options = options
        self.completed = 0
        self.abandoned = 0

    def _run(self) -> None:
        client = servicebus_client(self._connection)
        try:
            while not self._stop.is_set():
                try:
                    self._pump(client)
                except (ServiceBusError, OSError) as exc:
                    # The receiver broke (connection lost, entity missing): reopen after a pause.
                    log.warning("receiver failed; reopening", extra=ids(queue=self.queue, error=repr(exc)))
                    self._stop.wait(2.0)
                except Exception:
                    # Anything else must not end the trigger's thread: a dead pump delivers nothing again
                    # while the poller keeps sending (as the Functions host restarts a listener).
                    log.exception("receiver loop failed; reopening", extra=ids(queue=self.queue))
                    self._stop.wait(2.0)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            client.close()

    def _pump(self, client: ServiceBusClient) -> None:
        receiver = self.trigger.receiver(client, prefetch_count=self.options.prefetch_count, **receiver_options())
        with receiver:
            while not self._stop.is_set():
                self._settle_finished(receiver, block=False)
                self._renew_due(receiver)
                free = self.options.max_concurrent_calls - len(self._inflight)
                if free <= 0:
                    self._settle_finished(receiver, block=True)
                    continue
                # One message per receive for single-message functions; a batch is filled for at
                # most 20 ms after its first message, as the extension's batch receive does
                # (batch_receive.py). Prefetched messages are taken without waiting.
                count = self.options.max_message_batch_size if self.many else 1
                wait = self._busy_wait if self._inflight else self._idle_wait
                messages = receive_batch(receiver, count, wait)
                if messages:
                    self._dispatch(messages)
            self._drain(receiver)

    def _drain(self, receiver: ServiceBusReceiver) -> None:
        """Graceful stop: let in-flight calls finish (bounded), settling each as it ends."""
        deadline = time.monotonic() + self._grace
        while self._inflight and time.monotonic() < deadline:
            self._renew_due(receiver)
            self._settle_finished(receiver, block=True)
        if self._inflight:
            # Unsettled messages are not lost: their locks expire and Service Bus redelivers them.
            log.warning("stopped with calls still running", extra=ids(queue=self.queue, running=len(self._inflight)))

    # ---- invocations -------------------------------------------------------------------------
    def _dispatch(self, messages: list[ServiceBusReceivedMessage]) -> None:
        groups = [messages] if self.many else [[m] for m in messages]
        now = dt.datetime.now(dt.UTC)
        for group in groups:
            locked_until = group[0].locked_until_utc
            span = (locked_until - now).total_seconds() if locked_until else 0.0
            invocation = _Invocation(group, lock_span=max(span, 1.0))
            self._inflight.add(invocation)
            self._pool.submit(self._call, invocation)

    def _call(self, invocation: _Invocation) -> None:
        try:
            call_with_messages(self.spec, invocation.messages, self.many)
        except BaseException as exc:  # any failure abandons; kept for the pump to settle
            invocation.error = exc
        finally:
            self._done.put(invocation)

    def _settle_finished(self, receiver: ServiceBusReceiver, *, block: bool) -> None:
        try:
            invocation = self._done.get(timeout=self._busy_wait) if block else self._done.get_nowait()
        except queue.Empty:
            return
        while True:
            self._settle(receiver, invocation)
            try:
                invocation = self._done.get_nowait()
            except queue.Empty:
                return

    def _settle(self, receiver: ServiceBusReceiver, invocation: _Invocation) -> None:
        self._inflight.discard(invocation)
        if not self.options.auto_complete_messages:
            return  # the function settles (or the lock expires), as with autoCompleteMessages false
        settled = settle_bus(receiver, invocation.messages, invocation.error)
        if invocation.error is None:
            self.completed += settled
        else:
            self.abandoned += settled

    def _renew_due(self, receiver: ServiceBusReceiver) -> None:
        if self.many:
            return  # the Functions host renews locks for single-message functions only
        now = time.monotonic()
        utcnow = dt.datetime.now(dt.UTC)
        for invocation in list(self._inflight):
            if not invocation.renew or now - invocation.started > self.options.max_auto_lock_renewal_seconds:
                continue
            msg = invocation.messages[0]
            if msg.locked_until_utc is None:
                continue
            remaining = (msg.locked_until_utc - utcnow).total_seconds()
            if remaining > invocation.lock_span / 2:
                continue
            try:
                receiver.renew_message_lock(msg)
            except (ServiceBusError, OSError) as exc:
                keys = ids(queue=self.queue, message_id=str(msg.message_id), error=repr(exc))
                log.warning("lock renewal failed; the message may be redelivered", extra=keys)
                invocation.renew = False  # stop trying; settlement will report the lost lock
