"""One in-memory OpenTelemetry SDK per test process (metrics and traces).

The global providers can be set once per process, and dbfanout's instruments (created on the API's
proxies at import) record into whatever provider is set first: every test that reads telemetry
installs through here and reads the same reader and span exporter.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

READER = InMemoryMetricReader()
SPANS = InMemorySpanExporter()
_installed = False


def install() -> None:
    """Set the global meter and tracer providers (once)."""
    global _installed
    if _installed:
        return
    otel_metrics.set_meter_provider(MeterProvider(metric_readers=[READER]))
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(SPANS))
    trace.set_tracer_provider(provider)
    _installed = True


Points = dict[str, list[tuple[dict[str, Any], Any]]]


def points() -> Points:
    """Every data point now: name -> [(attributes, point)] (counters: .value, histograms: .count/.sum)."""
    data = READER.get_metrics_data()
    out: Points = {}
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for p in metric.data.data_points:
                    out.setdefault(metric.name, []).append((dict(p.attributes or {}), p))
    return out


def total(name: str, **attrs: Any) -> float:
    """Sum of a counter's values (or a histogram's counts) over points whose attributes include ``attrs``."""
    found = 0.0
    for point_attrs, p in points().get(name, []):
        if all(point_attrs.get(k) == v for k, v in attrs.items()):
            found += float(p.count if hasattr(p, "count") else p.value)
    return found


def spans(name: str | None = None) -> list[ReadableSpan]:
    return [s for s in SPANS.get_finished_spans() if name is None or s.name == name]
