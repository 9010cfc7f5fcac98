"""OpenTelemetry metrics through the API only: no-ops unless the app configures an SDK.

``function_app.py`` configures one when the environment asks for it (``shared.otel_setup``:
Azure Monitor, OTLP); the names below are a contract (docs/operations.md, section 6, has the
table). Every instrument carries ``poller``; the worker's also ``queue`` (the queue, or the
topic) and, for a topic, ``subscription``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from opentelemetry import metrics as otel_metrics
from opentelemetry.metrics import CallbackOptions, NoOpMeterProvider, Observation

__all__ = ["LatestValue", "Metrics", "metrics", "recording"]

Attributes = Mapping[str, str]


class LatestValue:
    """An observable gauge's source: the latest value per attribute set, read at each export.

    ``record(value, attributes)`` has the histogram's signature, so callers need not know the
    difference (``dbfanout.last_success_timestamp`` was a histogram before it became a gauge).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[tuple[str, str], ...], float] = {}

    def record(self, value: float, attributes: Attributes | None = None) -> None:
        key = tuple(sorted((attributes or {}).items()))
        with self._lock:
            self._values[key] = float(value)

    def observe(self, _options: CallbackOptions | None = None) -> Iterable[Observation]:
        with self._lock:
            items = list(self._values.items())
        return [Observation(value, dict(key)) for key, value in items]

    def get(self, attributes: Attributes) -> float | None:
        with self._lock:
            return self._values.get(tuple(sorted(attributes.items())))


@dataclass(frozen=True)
class Metrics:
    rows_fetched: otel_metrics.Counter
    messages_enqueued: otel_metrics.Counter
    failures: otel_metrics.Counter
    lag_seconds: otel_metrics.Histogram
    last_success_timestamp: LatestValue  # observable gauge: unix time of the last successful tick
    handler_duration: otel_metrics.Histogram
    events_handled: otel_metrics.Counter
    messages_split: otel_metrics.Counter
    deliveries_failed: otel_metrics.Counter
    events_dead_lettered: otel_metrics.Counter
    duplicates_absorbed: otel_metrics.Counter
    commit_to_handler: otel_metrics.Histogram
    retained_wal_bytes: LatestValue  # observable gauge, pg_logical pollers
    lag_wal_bytes: LatestValue  # observable gauge, pg_logical pollers: WAL not yet delivered
    wal_headroom_bytes: LatestValue  # observable gauge, pg_logical pollers: WAL left before the slot is lost
    lag_rows: LatestValue  # observable gauge, keyset and outbox pollers: rows not yet sent (bounded)
    sink_refusing: LatestValue  # observable gauge: 1 while the broker refuses sends (with ``reason``), else 0
    sends_refused: otel_metrics.Counter  # sends the broker refused (queue full, throttled, unreachable)
    snapshot_chunks_refused: otel_metrics.Counter  # pg_logical snapshots: chunk reads refused (retried)
    truncates: otel_metrics.Counter  # TRUNCATEs of a polled table read from the log (not delivered as rows)


def _build() -> Metrics:
    meter = otel_metrics.get_meter("dbfanout")
    last_success, retained_wal, lag_wal, lag_rows = LatestValue(), LatestValue(), LatestValue(), LatestValue()
    wal_headroom = LatestValue()
    sink_refusing = LatestValue()
    meter.create_observable_gauge(
        "dbfanout.sink_refusing",
        callbacks=[sink_refusing.observe],
        unit="1",
        description="1 while the broker refuses the poller's sends (queue full, throttled, unreachable) and the "
        "poller backs off, 0 once it accepts again; attribute reason",
    )
    meter.create_observable_gauge(
        "dbfanout.last_success_timestamp",
        callbacks=[last_success.observe],
        unit="s",
        description="unix time of the poller's last tick that ended without error",
    )
    meter.create_observable_gauge(
        "dbfanout.lag_rows",
        callbacks=[lag_rows.observe],
        unit="{row}",
        description="rows after the checkpoint not yet sent (keyset, outbox), counted up to 10,000 when a tick "
        "stops short of the end; 0 after a tick that caught up",
    )
    meter.create_observable_gauge(
        "dbfanout.pg_logical.retained_wal",
        callbacks=[retained_wal.observe],
        unit="By",
        description="WAL the poller's replication slot holds back (pg_logical)",
    )
    meter.create_observable_gauge(
        "dbfanout.pg_logical.wal_headroom",
        callbacks=[wal_headroom.observe],
        unit="By",
        description="WAL that can still be written before PostgreSQL invalidates the poller's slot "
        "(pg_replication_slots.safe_wal_size; reported only when max_slot_wal_keep_size is set)",
    )
    meter.create_observable_gauge(
        "dbfanout.pg_logical.lag",
        callbacks=[lag_wal.observe],
        unit="By",
        description="WAL after the slot's confirmed position: the backlog not yet delivered (pg_logical)",
    )
    return Metrics(
        rows_fetched=meter.create_counter("dbfanout.rows_fetched", unit="{row}"),
        messages_enqueued=meter.create_counter("dbfanout.messages_enqueued", unit="{message}"),
        failures=meter.create_counter("dbfanout.failures", unit="{failure}", description="failures by stage"),
        lag_seconds=meter.create_histogram("dbfanout.lag", unit="s", description="now - cursor of the last row sent"),
        last_success_timestamp=last_success,
        handler_duration=meter.create_histogram("dbfanout.handler.duration", unit="s"),
        events_handled=meter.create_counter("dbfanout.events_handled", unit="{event}"),
        messages_split=meter.create_counter("dbfanout.messages_split", unit="{message}"),
        deliveries_failed=meter.create_counter(
            "dbfanout.deliveries.failed", unit="{delivery}", description="deliveries whose handler raised"
        ),
        events_dead_lettered=meter.create_counter(
            "dbfanout.events.dead_lettered",
            unit="{event}",
            description="events whose last allowed delivery failed (they are in the DLQ or poison queue now)",
        ),
        duplicates_absorbed=meter.create_counter(
            "dbfanout.events.duplicates",
            unit="{event}",
            description="events ProcessedEvents.fresh found already handled (redeliveries it absorbed)",
        ),
        commit_to_handler=meter.create_histogram(
            "dbfanout.commit_to_handler",
            unit="s",
            description="source commit time (or the best time the source knows, see commit_time) to handler done, "
            "one observation per commit a handled message carried",
        ),
        retained_wal_bytes=retained_wal,
        lag_wal_bytes=lag_wal,
        wal_headroom_bytes=wal_headroom,
        lag_rows=lag_rows,
        sink_refusing=sink_refusing,
        sends_refused=meter.create_counter(
            "dbfanout.sends_refused",
            unit="{send}",
            description="sends the broker refused (attribute reason: queue_full, throttled, unreachable); "
            "ticks inside the backoff window send nothing and count nothing",
        ),
        snapshot_chunks_refused=meter.create_counter(
            "dbfanout.snapshot_chunks_refused",
            unit="{chunk}",
            description="snapshot chunk reads refused because a committed transaction was not visible yet "
            "(pg_logical; retried with backoff and a smaller chunk)",
        ),
        truncates=meter.create_counter(
            "dbfanout.truncates",
            unit="{truncate}",
            description="TRUNCATEs of a polled table the poller read from the log (mysql_binlog: not delivered; "
            "targets keep the truncated rows), attribute table",
        ),
    )


def recording() -> bool:
    """Whether an SDK meter provider is configured (per-event observations are skipped otherwise)."""
    provider = otel_metrics.get_meter_provider()
    return not isinstance(provider, NoOpMeterProvider) and type(provider).__name__ != "_ProxyMeterProvider"


metrics = _build()
