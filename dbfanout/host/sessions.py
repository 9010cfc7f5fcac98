"""Session-enabled Service Bus queue (and topic-subscription) triggers, served the way the
Functions host serves them.

The host's session processor (Service Bus extension 5.x) holds up to ``maxConcurrentSessions``
sessions at once. Within a session it makes one call at a time (``maxConcurrentCallsPerSession``
is 1), in order, and each call carries messages of that one session only: one message, or up to
``maxMessageBatchSize`` for ``cardinality="many"``. It renews the session lock while it holds the
session and releases the session once no message arrived for ``sessionIdleTimeout``. Success
completes, an exception abandons (:func:`worker.settlement.settle_bus`, like every other trigger);
an abandoned message comes back first in its session, so the changes of one key are handled in
order even across redeliveries.

Each session slot is a thread that owns its client and its session receiver and does every AMQP
operation on it (SDK handlers are not thread-safe); the function runs on the pool meanwhile, and
the slot renews the session lock while it waits.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from azure.servicebus import NEXT_AVAILABLE_SESSION, ServiceBusClient, ServiceBusReceivedMessage, ServiceBusReceiver
from azure.servicebus.exceptions import OperationTimeoutError, ServiceBusError, SessionCannotBeLockedError

from dbfanout.host.app_loader import FunctionSpec
from dbfanout.host.batch_receive import receive_batch, receiver_options
from dbfanout.host.hostjson import ServiceBusOptions
from dbfanout.host.runner import TriggerRunner
from dbfanout.host.servicebus import ServiceBusTrigger, call_with_messages
from shared.logs import get_logger, ids
from shared.servicebus import servicebus_client
from worker.settlement import settle_bus

__all__ = ["SessionQueueRunner"]

log = get_logger("host.sessions")


@dataclass(eq=False)
class _Call:
    messages: list[ServiceBusReceivedMessage]
    started: float = field(default_factory=time.monotonic)
    error: BaseException | None = None


@dataclass(eq=False)
class _Held:
    """A session this slot holds: its receiver, and the lock span seen when it was accepted."""

    receiver: ServiceBusReceiver
    lock_span: float | None = None


class SessionQueueRunner(TriggerRunner[_Call]):
    """Feeds one session-enabled queue-triggered function until stopped."""

    _accept_wait = 1.0  # how long one accept waits for a session with messages
    _poll = 0.5  # the slot's tick while a call runs or a session idles (stop, renewal)

    def __init__(self, spec: FunctionSpec, settings: Mapping[str, str], options: ServiceBusOptions) -> None:
        self.trigger = ServiceBusTrigger.of(spec, settings)
        super().__init__(spec, self.trigger.queue, options.max_concurrent_sessions)
        self.options = options
        self._counts = threading.Lock()
        self.completed = 0
        self.abandoned = 0
        self.sessions_served = 0

    def _run(self) -> None:
        slots = [
            threading.Thread(target=self._slot, name=f"session:{self.spec.name}:{n}", daemon=True)
            for n in range(self.options.max_concurrent_sessions)
        ]
        for slot in slots:
            slot.start()
        for slot in slots:
            slot.join()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _slot(self) -> None:
        """Accept the next session with messages, serve it until idle, repeat until stopped."""
        # One client per slot: clients are not thread-safe. No SDK retries: an accept that finds no
        # session is an ordinary outcome here, retried by this loop.
        client = servicebus_client(self.trigger.connection, retry_total=0)
        try:
            while not self._stop.is_set():
                try:
                    self._serve_next_session(client)
                except (OperationTimeoutError, SessionCannotBeLockedError):
                    continue  # no session had messages, or another slot took it first
                except (ServiceBusError, OSError) as exc:
                    log.warning("session receiver failed; reopening", extra=ids(queue=self.queue, error=repr(exc)))
                    self._stop.wait(2.0)
        finally:
            client.close()

    def _serve_next_session(self, client: ServiceBusClient) -> None:
        receiver = self.trigger.receiver(
            client,
            session_id=NEXT_AVAILABLE_SESSION,
            max_wait_time=self._accept_wait,
            prefetch_count=self.options.prefetch_count,
            **receiver_options(),
        )
        with receiver:
            held = _Held(receiver)
            count = self.options.max_message_batch_size if self.trigger.many else 1
            while not self._stop.is_set():
                messages = self._receive_until_idle(held, count)
                if not messages:
                    return  # idle for sessionIdleTimeout: release the session, take the next one
                if held.lock_span is None:
                    self._accepted(held)
                if not self._call_and_settle(held, messages):
                    return  # stopped while a call outlived the grace period: leave it to the lock

    def _receive_until_idle(self, held: _Held, count: int) -> list[ServiceBusReceivedMessage]:
        idle_until = time.monotonic() + self.options.session_idle_timeout_seconds
        while not self._stop.is_set():
            wait = min(self._poll, idle_until - time.monotonic())
            if wait <= 0:
                return []
            messages = receive_batch(held.receiver, count, wait)
            if messages:
                return messages
            self._renew_session(held, None)
        return []

    def _accepted(self, held: _Held) -> None:
        locked_until = held.receiver.session.locked_until_utc
        held.lock_span = max((locked_until - _utcnow()).total_seconds(), 1.0) if locked_until else 0.0
        with self._counts:
            self.sessions_served += 1
        log.debug("session accepted", extra=ids(queue=self.queue, session=str(held.receiver.session.session_id)))

    def _call_and_settle(self, held: _Held, messages: list[ServiceBusReceivedMessage]) -> bool:
        """One call in this session; False when it had to be left unsettled at stop."""
        call = _Call(messages)
        self._inflight.add(call)
        future = self._pool.submit(self._invoke, call)
        stopped_at: float | None = None
        while not self._finished(future):
            self._renew_session(held, call)
            if self._stop.is_set():
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at > self._grace:
                    log.warning("stopped with a session call still running", extra=ids(queue=self.queue))
                    return False
        self._inflight.discard(call)
        if not self.options.auto_complete_messages:
            return True  # the function settles (or the session lock expires)
        settled = settle_bus(held.receiver, messages, call.error)
        with self._counts:
            if call.error is None:
                self.completed += settled
            else:
                self.abandoned += settled
        return True

    def _finished(self, future: Future[None]) -> bool:
        try:
            future.result(timeout=self._poll)
        except FutureTimeout:
            return False
        return True

    def _invoke(self, call: _Call) -> None:
        try:
            call_with_messages(self.spec, call.messages, self.trigger.many)
        except BaseException as exc:  # any failure abandons; kept for the slot to settle
            call.error = exc

    def _renew_session(self, held: _Held, call: _Call | None) -> None:
        """Renew the session lock at half its span; during a call, for ``maxAutoLockRenewalDuration`` at most."""
        if not held.lock_span:
            return
        if call is not None and time.monotonic() - call.started > self.options.max_auto_lock_renewal_seconds:
            return
        session = held.receiver.session
        locked_until = session.locked_until_utc
        if locked_until is None or (locked_until - _utcnow()).total_seconds() > held.lock_span / 2:
            return
        try:
            session.renew_lock()
        except (ServiceBusError, OSError) as exc:
            keys = ids(queue=self.queue, session=str(session.session_id), error=repr(exc))
            log.warning("session lock renewal failed; its messages may be redelivered", extra=keys)


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)
