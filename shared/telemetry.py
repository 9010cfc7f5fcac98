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
    truncates: otel_metrics.Counter  # log sources: TRUNCATEs of the poller's tables (not delivered as events)
    unknown_relation_changes: otel_metrics.Counter  # pg_logical: changes of relations not in tables (skipped)


#: field → (kind, name, unit, description): the instruments of :class:`Metrics`, in its order. A
#: "gauge" is an observable gauge read from a :class:`LatestValue` at each export.
_INSTRUMENTS: dict[str, tuple[str, str, str, str]] = {
    "rows_fetched": ("counter", "dbfanout.rows_fetched", "{row}", ""),
    "messages_enqueued": ("counter", "dbfanout.messages_enqueued", "{message}", ""),
    "failures": ("counter", "dbfanout.failures", "{failure}", "failures by stage"),
    "lag_seconds": ("histogram", "dbfanout.lag", "s", "now - cursor of the last row sent"),
    "last_success_timestamp": (
        "gauge",
        "dbfanout.last_success_timestamp",
        "s",
        "unix time of the poller's last tick that ended without error",
    ),
    "handler_duration": ("histogram", "dbfanout.handler.duration", "s", ""),
    "events_handled": ("counter", "dbfanout.events_handled", "{event}", ""),
    "messages_split": ("counter", "dbfanout.messages_split", "{message}", ""),
    "deliveries_failed": ("counter", "dbfanout.deliveries.failed", "{delivery}", "deliveries whose handler raised"),
    "events_dead_lettered": (
        "counter",
        "dbfanout.events.dead_lettered",
        "{event}",
        "events whose last allowed delivery failed (they are in the DLQ or poison queue now)",
    ),
    "duplicates_absorbed": (
        "counter",
        "dbfanout.events.duplicates",
        "{event}",
        "events ProcessedEvents.fresh found already handled (redeliveries it absorbed)",
    ),
    "commit_to_handler": (
        "histogram",
        "dbfanout.commit_to_handler",
        "s",
        "source commit time (or the best time the source knows, see commit_time) to handler done, "
        "one observation per commit a handled message carried",
    ),
    "retained_wal_bytes": (
        "gauge",
        "dbfanout.pg_logical.retained_wal",
        "By",
        "WAL the poller's replication slot holds back (pg_logical)",
    ),
    "lag_wal_bytes": (
        "gauge",
        "dbfanout.pg_logical.lag",
        "By",
        "WAL after the slot's confirmed position: the backlog not yet delivered (pg_logical)",
    ),
    "wal_headroom_bytes": (
        "gauge",
        "dbfanout.pg_logical.wal_headroom",
        "By",
        "WAL that can still be written before PostgreSQL invalidates the poller's slot "
        "(pg_replication_slots.safe_wal_size; reported only when max_slot_wal_keep_size is set)",
    ),
    "lag_rows": (
        "gauge",
        "dbfanout.lag_rows",
        "{row}",
        "rows after the checkpoint not yet sent (keyset, outbox), counted up to 10,000 when a tick "
        "stops short of the end; 0 after a tick that caught up",
    ),
    "sink_refusing": (
        "gauge",
        "dbfanout.sink_refusing",
        "1",
        "1 while the broker refuses the poller's sends (queue full, throttled, unreachable) and the "
        "poller backs off, 0 once it accepts again; attribute reason",
    ),
    "sends_refused": (
        "counter",
        "dbfanout.sends_refused",
        "{send}",
        "sends the broker refused (attribute reason: queue_full, throttled, unreachable); "
        "ticks inside the backoff window send nothing and count nothing",
    ),
    "snapshot_chunks_refused": (
        "counter",
        "dbfanout.snapshot_chunks_refused",
        "{chunk}",
        "snapshot chunk reads refused because a committed transaction was not visible yet "
        "(pg_logical; retried with backoff and a smaller chunk)",
    ),
    "truncates": (
        "counter",
        "dbfanout.truncates",
        "{truncate}",
        "TRUNCATEs of the poller's tables read from the log (pg_logical, mysql_binlog; attribute table); no event "
        "is delivered for them, so a target keeps the truncated rows",
    ),
    "unknown_relation_changes": (
        "counter",
        "dbfanout.pg_logical.unknown_relation_changes",
        "{change}",
        "changes the slot sent for a relation not in the poller's tables (attribute relation), not delivered",
    ),
}


def _build() -> Metrics:
    meter = otel_metrics.get_meter("dbfanout")
    built: dict[str, object] = {}
    for field_name, (kind, name, unit, description) in _INSTRUMENTS.items():
        if kind == "gauge":
            value = built[field_name] = LatestValue()
            meter.create_observable_gauge(name, callbacks=[value.observe], unit=unit, description=description)
        elif kind == "counter":
            built[field_name] = meter.create_counter(name, unit=unit, description=description)
        else:
            built[field_name] = meter.create_histogram(name, unit=unit, description=description)
    return Metrics(**built)  # type: ignore[arg-type]  # a field missing from the table fails at import


def recording() -> bool:
    """Whether an SDK meter provider is configured (per-event observations are skipped otherwise)."""
    provider = otel_metrics.get_meter_provider()
    return not isinstance(provider, NoOpMeterProvider) and type(provider).__name__ != "_ProxyMeterProvider"


metrics = _build()
