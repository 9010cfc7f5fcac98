"""OpenTelemetry metrics through the API only: no-ops unless the app configures an SDK.

On Azure Functions, ``azure-monitor-opentelemetry`` (see the operations guide) exports them.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import metrics as otel_metrics

__all__ = ["Metrics", "metrics"]


@dataclass(frozen=True)
class Metrics:
    rows_fetched: otel_metrics.Counter
    messages_enqueued: otel_metrics.Counter
    failures: otel_metrics.Counter
    lag_seconds: otel_metrics.Histogram
    last_success_timestamp: otel_metrics.Histogram
    handler_duration: otel_metrics.Histogram
    events_handled: otel_metrics.Counter
    messages_split: otel_metrics.Counter


def _build() -> Metrics:
    meter = otel_metrics.get_meter("dbfanout")
    return Metrics(
        rows_fetched=meter.create_counter("dbfanout.rows_fetched", unit="{row}"),
        messages_enqueued=meter.create_counter("dbfanout.messages_enqueued", unit="{message}"),
        failures=meter.create_counter("dbfanout.failures", unit="{failure}", description="failures by stage"),
        lag_seconds=meter.create_histogram("dbfanout.lag", unit="s", description="now - cursor of the last row sent"),
        last_success_timestamp=meter.create_histogram("dbfanout.last_success_timestamp", unit="s"),
        handler_duration=meter.create_histogram("dbfanout.handler.duration", unit="s"),
        events_handled=meter.create_counter("dbfanout.events_handled", unit="{event}"),
        messages_split=meter.create_counter("dbfanout.messages_split", unit="{message}"),
    )


metrics = _build()
