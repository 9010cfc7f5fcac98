"""Everything one poller keeps across ticks: a pooled engine, its state store and its sender.

Built lazily on the first tick (``function_app.py`` indexing must open no connections) and
reused afterwards: opening a Service Bus sender costs about a second. The poller's lease is kept
between ticks too (:class:`~poller.lease.keeper.StickyLease`) and released by :meth:`PollerRuntime.close`.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable

from azure.servicebus import ServiceBusClient

from poller.lease.keeper import StickyLease
from poller.ports import Sink, Source, StateStore
from poller.sinks.queue import ClaimCheckHook
from poller.sinks.servicebus import ServiceBusSink
from poller.sinks.storagequeue import StorageQueueSink
from poller.state.blob import open_state_store
from poller.tick.backoff import SinkRefusals
from poller.tick.lifecycle import TickResult, default_owner_id, run_tick
from poller.tick.wake import Waker, open_waker
from shared.claimcheck import open_claim_check
from shared.closing import close_and_clear
from shared.config import Config
from shared.logs import get_logger, ids
from shared.servicebus import EntityKind, LazyServiceBusClient, QueueSender
from shared.settings import storage_connection
from shared.storagequeue import StorageQueueSender, queue_service_client

__all__ = ["CLOSE_WAIT_SECONDS", "PollerRuntime", "Runtimes"]

log = get_logger("poller.runtime")

#: How long closing a runtime waits for its running tick before closing without releasing the lease.
CLOSE_WAIT_SECONDS = 15.0


class PollerRuntime:
    """One poller's long-lived parts. Pass any part explicitly to replace it (tests, benchmarks)."""

    def __init__(
        self,
        config: Config,
        poller: str,
        *,
        source: Source | None = None,
        store: StateStore | None = None,
        sink: Sink | None = None,
        bus: Callable[[], ServiceBusClient] | None = None,
        owner_id: str | None = None,
    ) -> None:
        self.config = config
        self.poller = config.poller(poller)
        self._source = source
        self._store = store
        self._sink = sink
        self._bus = bus
        self.owner_id = owner_id or default_owner_id()
        self._lease: StickyLease | None = None
        self._stopping = threading.Event()
        self._waker: Waker | None = None
        self._lock = threading.Lock()  # one tick at a time in this process
        self.refusals = SinkRefusals(self.poller.name)  # a refusing broker's backoff, across ticks

    @property
    def source(self) -> Source:
        if self._source is None:
            from poller.sources.factory import open_source  # SQLAlchemy reflection happens here, not at import

            self._source = open_source(self.poller)
        return self._source

    @property
    def store(self) -> StateStore:
        if self._store is None:
            app = self.config.app
            conn = storage_connection(self.config.settings, app.state_connection)
            # The timeout the lease margins allow: two timed-out heartbeats fit before expiry.
            self._store = open_state_store(
                conn, app.state_container, app.name, self.poller.name, request_timeout=self.poller.state_timeout
            )
        return self._store

    @property
    def sink(self) -> Sink:
        if self._sink is None:
            self._sink = self._storage_queue_sink() if self.poller.transport == "storage-queue" else self._bus_sink()
        return self._sink

    def _bus_sink(self) -> Sink:
        if self._bus is None:
            self._bus = LazyServiceBusClient(self.config.settings, self.config.app.servicebus_connection)
        # A topic poller sends each batch once to its topic: every subscription gets a copy.
        kind: EntityKind = "topic" if self.poller.is_topic else "queue"
        sender = QueueSender(self._bus(), self.poller.queue, kind=kind)
        return ServiceBusSink(self.poller, sender, claim_check=self._claim_check())

    def _storage_queue_sink(self) -> Sink:
        conn = storage_connection(self.config.settings, self.config.app.storage_queue_connection)
        queue = queue_service_client(conn).get_queue_client(self.poller.queue)
        return StorageQueueSink(self.poller, StorageQueueSender(queue), claim_check=self._claim_check())

    def _claim_check(self) -> ClaimCheckHook | None:
        """Where oversize rows go with ``oversize_policy = "claim-check"``: the state account's claims."""
        if self.poller.oversize_policy != "claim-check":
            return None
        return open_claim_check(self.config).offload

    @property
    def lease(self) -> StickyLease:
        """The lease this process keeps between ticks (:class:`~poller.lease.keeper.StickyLease`)."""
        if self._lease is None:
            ttl = dt.timedelta(seconds=self.poller.lease_ttl_seconds)
            self._lease = StickyLease(
                self.store, self.owner_id, ttl, self.source.fingerprint, on_not_owner=self._stop_listening
            )
        return self._lease

    def tick(self, next_occurrence: dt.datetime | None = None) -> TickResult:
        """One tick; ``next_occurrence`` (the timer's next firing) bounds a lingering tick."""
        self.poller.require_settings()  # a poller missing its settings fails here, alone
        with self._lock:
            return run_tick(
                self.poller,
                self.source,
                self.store,
                self.sink,
                owner_id=self.owner_id,
                lease=self.lease,
                next_occurrence=next_occurrence,
                stop=self._stopping,
                waker=self.waker,
                refusals=self.refusals,
            )

    def _stop_listening(self) -> None:
        """Close the LISTEN connection when this process learns it does not hold the lease (or
        gives it up): the owner listens (and reads); a connection nobody reads would pin
        PostgreSQL's notification queue. The next tick that holds the lease listens again."""
        if self._waker is not None:
            self._waker.close()

    @property
    def waker(self) -> Waker | None:
        """How a lingering tick waits for a commit (``wake = "notify"``: LISTEN; ``"wal"``: the WAL
        flush position), kept across ticks while this process holds the lease."""
        if self._waker is None:
            self._waker = open_waker(self.poller)
        return self._waker

    def close(self) -> None:
        """Release the kept lease (another instance takes over at its next tick), then close.

        Waits up to :data:`CLOSE_WAIT_SECONDS` for a running tick (it may still commit under the
        lease); a tick stuck longer keeps the lease, which then lapses after its TTL.
        """
        self._stopping.set()  # a lingering tick ends at its next poll instead of its deadline
        idle = self._lock.acquire(timeout=CLOSE_WAIT_SECONDS)
        try:
            lease, self._lease = self._lease, None
            if lease is not None and idle:
                lease.release()
            elif lease is not None:
                keys = ids(poller=self.poller.name)
                log.warning("a tick is still running; its lease lapses after the TTL", extra=keys)
            for part in (self._sink, self._source, self._waker):
                if part is not None:
                    part.close()
        finally:
            if idle:
                self._lock.release()


class Runtimes:
    """The process-wide runtimes of an app, one per poller, created on first use."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._runtimes: dict[str, PollerRuntime] = {}
        self._lock = threading.Lock()
        # Its own lock inside: called from inside a tick, while get() may run.
        self._shared_bus = LazyServiceBusClient(config.settings, config.app.servicebus_connection)

    def get(self, poller: str) -> PollerRuntime:
        with self._lock:
            if poller not in self._runtimes:
                self._runtimes[poller] = PollerRuntime(self.config, poller, bus=self._shared_bus)
            return self._runtimes[poller]

    def close(self) -> None:
        with self._lock:
            close_and_clear(self._runtimes)
            self._shared_bus.close()
