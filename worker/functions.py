"""The queue side of ``function_app.py``: one Service Bus trigger per queue (``work_<queue>``)
and one per topic subscription (``work_<topic>_<subscription>``).

Settlement follows the host's autoComplete semantics: returning completes the message,
raising abandons it (delivery count + 1), and Service Bus dead-letters it after the queue's
(the subscription's) MaxDeliveryCount. Splitting a failing multi-event message sends the singles
first and then returns, so the parent completes only after every single was accepted.
"""

from __future__ import annotations

import datetime as dt
import re
import threading
import typing
from collections.abc import Callable, Mapping
from pathlib import Path

import azure.functions as func

from shared.claimcheck import ClaimCheck, is_claim, open_claim_check
from shared.closing import close_and_clear
from shared.config import Config
from shared.errors import ConfigError
from shared.failures import FailureRecord, FailureStore, open_failure_store
from shared.messages import OutgoingMessage
from shared.models import RowChange
from shared.scrub import scrubbed_errors
from shared.servicebus import LazyServiceBusClient, QueueSender
from shared.storagequeue import StorageQueueSender, queue_service_client
from worker.runtime import Delivery, Worker
from worker.split import Splitter

__all__ = [
    "WorkerApp",
    "batch_failure",
    "delivery_from_functions",
    "delivery_from_storage_queue",
    "queue_function_name",
    "subscription_function_name",
    "worker_blueprint",
]


def queue_function_name(queue: str) -> str:
    return "work_" + re.sub(r"\W", "_", queue)


def subscription_function_name(topic: str, subscription: str) -> str:
    """``work_<topic>_<subscription>``, every non-word character as ``_`` (like :func:`queue_function_name`)."""
    return queue_function_name(f"{topic}_{subscription}")


def delivery_from_storage_queue(msg: func.QueueMessage) -> Delivery:
    """A queue-trigger message (the host already decoded the base64 text; dequeue count is 1-based)."""
    return _delivery(msg.get_body(), msg.id, msg.dequeue_count, msg.insertion_time)


def delivery_from_functions(msg: func.ServiceBusMessage) -> Delivery:
    """What the Functions host hands us → the worker's view (its delivery count is 1-based)."""
    return _delivery(
        msg.get_body(), msg.message_id, msg.delivery_count, msg.enqueued_time_utc, msg.application_properties
    )


def _delivery(
    body: bytes,
    message_id: str | None,
    delivery_count: int | None,
    enqueued_time: dt.datetime | None,
    application_properties: Mapping[str, typing.Any] | None = None,
) -> Delivery:
    """The host's fields as the worker reads them: no id is "", no count is the first delivery."""
    return Delivery(
        body=body,
        message_id=message_id or "",
        delivery_count=int(delivery_count or 1),
        enqueued_time=enqueued_time,
        application_properties=dict(application_properties or {}),
    )


class WorkerApp:
    """The process-wide worker: built on first message, senders reused for splits."""

    def __init__(self, config: Config, app_root: Path | None = None) -> None:
        self.config = config
        self._app_root = app_root
        self._lock = threading.Lock()
        self._worker: Worker | None = None
        self._bus = LazyServiceBusClient(config.settings, config.app.servicebus_connection)
        self._senders: dict[str, QueueSender | StorageQueueSender] = {}
        self._claims: ClaimCheck | None = None
        self._failures: FailureStore | None = None

    def _send_all(self, queue: str, messages: list[OutgoingMessage]) -> None:
        """Where split singles go: back to the queue they came from, over its transport."""
        with self._lock:
            if queue not in self._senders:
                self._senders[queue] = self._sender_for(queue)
            sender = self._senders[queue]
        sender.send_all(messages)

    def _sender_for(self, queue: str) -> QueueSender | StorageQueueSender:
        if queue in self.config.topics():  # a topic poller's singles go back to its topic
            return QueueSender(self._bus(), queue, kind="topic")
        if self.config.queue_transport(queue) == "storage-queue":
            client = queue_service_client(self.config.connection("queue"))
            return StorageQueueSender(client.get_queue_client(queue))
        return QueueSender(self._bus(), queue)

    @property
    def worker(self) -> Worker:
        with self._lock:
            if self._worker is None:
                self._worker = Worker(
                    self.config,
                    splitter=Splitter(self.config, self._send_all),
                    app_root=self._app_root,
                    resolve_claims=self._resolve_claim,
                    failures=self,
                )
            return self._worker

    def _resolve_claim(self, event: RowChange) -> RowChange:
        """A claim-check reference → the stored event; the claim store is opened on the first one."""
        if not is_claim(event):
            return event
        with self._lock:
            if self._claims is None:
                self._claims = open_claim_check(self.config)
            claims = self._claims
        return claims.resolve(event)

    def _failure_store(self) -> FailureStore:
        with self._lock:
            if self._failures is None:
                self._failures = open_failure_store(self.config)
            return self._failures

    def record(self, record: FailureRecord, body: bytes) -> None:
        """The worker's failure recorder: the state container, opened on the first failure."""
        self._failure_store().record(record, body)

    def clear(self, entity: str, body: bytes) -> None:
        self._failure_store().clear(entity, body)

    def process(self, msg: func.ServiceBusMessage, subscription: str | None = None) -> None:
        """Handle a message of a queue, or of a topic's ``subscription``."""
        self.worker.process(delivery_from_functions(msg), subscription)

    def process_queue_message(self, msg: func.QueueMessage) -> None:
        self.worker.process(delivery_from_storage_queue(msg))

    def close(self) -> None:
        with self._lock:
            close_and_clear(self._senders)
            if self._failures is not None:
                self._failures.close()
                self._failures = None
            self._bus.close()


def worker_blueprint(
    config: Config, worker_app: WorkerApp | None = None, app_root: Path | None = None
) -> func.Blueprint:
    bp = func.Blueprint()
    shared = worker_app or WorkerApp(config, app_root)
    names: dict[str, str] = {}  # function name -> the TOML key it came from
    for queue, pollers in config.queues().items():
        name = _claim_name(names, queue_function_name(queue), f"pollers.{pollers[0].name}.queue")
        if config.queue_transport(queue) == "storage-queue":
            queue_trigger = bp.queue_trigger(
                arg_name="msg", queue_name=queue, connection=config.app.storage_queue_connection
            )
            bp.function_name(name)(queue_trigger(_storage_queue(shared, queue)))
            continue
        many = any(p.cardinality == "many" for p in pollers)
        sessions = any(p.sessions for p in pollers)
        trigger = bp.service_bus_queue_trigger(
            arg_name="msg",
            connection=config.app.servicebus_connection,
            queue_name=queue,
            cardinality=func.Cardinality.MANY if many else func.Cardinality.ONE,
            is_sessions_enabled=sessions or None,
        )
        bp.function_name(name)(trigger(_service_bus(shared, name, many)))
    for topic, poller in config.topics().items():
        for sub in poller.subscriptions.values():
            key = f"pollers.{poller.name}.subscriptions.{sub.name}"
            name = _claim_name(names, subscription_function_name(topic, sub.name), key)
            many = sub.cardinality == "many"
            trigger = bp.service_bus_topic_trigger(
                arg_name="msg",
                connection=config.app.servicebus_connection,
                topic_name=topic,
                subscription_name=sub.name,
                cardinality=func.Cardinality.MANY if many else func.Cardinality.ONE,
                is_sessions_enabled=poller.sessions or None,  # every subscription of the topic then
            )
            bp.function_name(name)(trigger(_service_bus(shared, name, many, sub.name)))
    return bp


def _claim_name(names: dict[str, str], name: str, key: str) -> str:
    """Reserve a function name; two entities mapping to one name would unindex the whole app."""
    if name in names:
        raise ConfigError(
            key,
            f"its function name {name} is already the function of {names[name]}",
            hint="rename the queue, topic or subscription (non-word characters become '_' in function names)",
        )
    names[name] = key
    return name


def _storage_queue(app: WorkerApp, queue: str) -> Callable[[func.QueueMessage], None]:
    def work(msg: func.QueueMessage) -> None:
        with scrubbed_errors():  # the host logs what leaves a function verbatim
            app.process_queue_message(msg)

    work.__name__ = queue_function_name(queue)
    return work


def _service_bus(
    app: WorkerApp, name: str, many: bool, subscription: str | None = None
) -> Callable[[func.ServiceBusMessage], None] | Callable[[typing.List[func.ServiceBusMessage]], None]:  # noqa: UP006
    """The function of a queue, or of a topic's ``subscription`` (it tells the worker which)."""
    return _many(app, name, subscription) if many else _one(app, name, subscription)


def _one(app: WorkerApp, name: str, subscription: str | None) -> Callable[[func.ServiceBusMessage], None]:
    def work(msg: func.ServiceBusMessage) -> None:
        with scrubbed_errors():  # the host logs what leaves a function verbatim
            app.process(msg, subscription)

    work.__name__ = name
    return work


# The Python worker accepts typing.List[...] on a binding but rejects PEP 585 list[...] ("invalid
# non-type annotation"), and one function that fails to load unindexes the whole app.
def _many(app: WorkerApp, name: str, subscription: str | None) -> Callable[[typing.List[func.ServiceBusMessage]], None]:  # noqa: UP006
    def work(msg: typing.List[func.ServiceBusMessage]) -> None:  # noqa: UP006
        # Handle every message; fail the invocation (all are redelivered) if any failed.
        errors: list[Exception] = []
        for one in msg:
            try:
                app.process(one, subscription)
            except Exception as exc:  # re-raised below, after the others had their turn
                exc.add_note(f"message_id={one.message_id} delivery_count={one.delivery_count}")
                errors.append(exc)
        if errors:
            with scrubbed_errors():
                raise batch_failure(errors, len(msg))

    work.__name__ = name
    return work


def batch_failure(errors: list[Exception], received: int) -> Exception:
    """One error carrying every failure of a ``cardinality="many"`` invocation (each with its ids)."""
    if len(errors) == 1:
        return errors[0]
    notes = "; ".join(str(n) for e in errors for n in getattr(e, "__notes__", ()))
    return ExceptionGroup(f"{len(errors)} of {received} messages failed ({notes})", errors)
