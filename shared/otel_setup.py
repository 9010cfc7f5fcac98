"""Where dbfanout's metrics and spans go: chosen by the environment, configured once per process.

- ``APPLICATIONINSIGHTS_CONNECTION_STRING`` set: Azure Monitor (``azure-monitor-opentelemetry``),
  with Entra auth when ``APPLICATIONINSIGHTS_AUTHENTICATION_STRING`` says ``Authorization=AAD``
  (what infra sets: the app's user-assigned identity; the resource has local auth off).
- else ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or a per-signal ``..._TRACES_``/``..._METRICS_ENDPOINT``)
  set: OTLP. ``OTEL_EXPORTER_OTLP_PROTOCOL`` picks ``http/protobuf`` (the default) or ``grpc``;
  the exporters and the SDK read the other standard variables themselves (headers, timeouts,
  ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_METRIC_EXPORT_INTERVAL``,
  ``OTEL_BSP_*``).
- ``PYTHON_APPLICATIONINSIGHTS_ENABLE_TELEMETRY=true``: the Azure Functions Python worker
  configures Azure Monitor itself (host.json ``telemetryMode: OpenTelemetry``); dbfanout then adds
  nothing, or every record would be exported twice.
- nothing set: nothing configured (the API stays a no-op and nothing is exported).

The exporter packages are optional (extras ``azure-monitor`` and ``otlp``) and imported only when
configured, so the app imports with ``requirements.txt`` alone; a configured exporter whose
package is missing is one warning naming the package, never a failed app.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any, Literal

from shared.logs import get_logger, ids

__all__ = ["Exporter", "chosen_exporter", "configure_telemetry", "shutdown_telemetry"]

log = get_logger("telemetry")

Exporter = Literal["azure-monitor", "otlp", "console", "platform", "none"]

SERVICE_NAME = "dbfanout"
_configured: Exporter | None = None


def chosen_exporter(env: Mapping[str, str]) -> Exporter:
    """Which exporter the settings ask for (no import, no side effect)."""
    if env.get("PYTHON_APPLICATIONINSIGHTS_ENABLE_TELEMETRY", "").lower() == "true":
        return "platform"
    if env.get("APPLICATIONINSIGHTS_CONNECTION_STRING"):
        return "azure-monitor"
    if any(
        env.get(name)
        for name in (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        )
    ):
        return "otlp"
    return "none"


def configure_telemetry(env: Mapping[str, str] | None = None, *, override: Exporter | None = None) -> Exporter:
    """Configure the exporter the settings (or ``override``: ``dbfanout run --otel``) ask for, once
    per process; returns what is in effect ("none" when nothing could be configured)."""
    global _configured
    if _configured is not None:
        return _configured
    settings = dict(os.environ if env is None else env)
    choice = override or chosen_exporter(settings)
    if choice not in ("none", "platform"):
        # Exemplars (a trace id kept with measurements, on by default inside sampled spans) cost about
        # 40% of each of the worker's per-event latency observations; OTEL_METRICS_EXEMPLAR_FILTER
        # set by the user wins.
        os.environ.setdefault("OTEL_METRICS_EXEMPLAR_FILTER", "always_off")
    try:
        if choice == "azure-monitor":
            _azure_monitor(settings)
        elif choice == "otlp":
            _sdk(_otlp_exporters(settings))
        elif choice == "console":
            _sdk(_console_exporters())
    except ImportError as exc:
        package = {"azure-monitor": "azure-monitor-opentelemetry", "otlp": "opentelemetry-exporter-otlp"}.get(
            choice, "opentelemetry-sdk"
        )
        log.warning(
            "telemetry export is configured but its package is not installed; nothing is exported",
            extra=ids(exporter=choice, missing=package, hint=f"add {package} to requirements.txt", error=str(exc)),
        )
        choice = "none"
    _configured = choice
    if choice not in ("none", "platform"):
        log.info("telemetry export configured", extra=ids(exporter=choice))
    return choice


def _azure_monitor(settings: Mapping[str, str]) -> None:
    from azure.monitor.opentelemetry import configure_azure_monitor

    options: dict[str, Any] = {
        "connection_string": settings["APPLICATIONINSIGHTS_CONNECTION_STRING"],
        # The Functions host already records invocations, Service Bus and storage calls; dbfanout
        # adds its own spans and metrics, not a second copy of the host's.
        "instrumentation_options": {name: {"enabled": False} for name in _DISTRO_INSTRUMENTATIONS},
        # The host already sends the worker's log records to Application Insights (traces table).
        "disable_logging": True,
    }
    auth = settings.get("APPLICATIONINSIGHTS_AUTHENTICATION_STRING", "")
    if "authorization=aad" in auth.replace(" ", "").lower():
        from azure.identity import ManagedIdentityCredential

        client_id = _field(auth, "ClientId")
        options["credential"] = (
            ManagedIdentityCredential(client_id=client_id) if client_id else ManagedIdentityCredential()
        )
    if not settings.get("OTEL_SERVICE_NAME"):
        from opentelemetry.sdk.resources import Resource

        options["resource"] = Resource.create({"service.name": SERVICE_NAME})
    configure_azure_monitor(**options)


_DISTRO_INSTRUMENTATIONS = (
    "azure_sdk",
    "django",
    "fastapi",
    "flask",
    "psycopg2",
    "requests",
    "urllib",
    "urllib3",
)


def _field(text: str, key: str) -> str | None:
    """``key=value`` of a ``;``-separated settings string (``ClientId=...;Authorization=AAD``)."""
    for part in text.split(";"):
        name, _, value = part.partition("=")
        if name.strip().lower() == key.lower() and value.strip():
            return value.strip()
    return None


def _otlp_exporters(settings: Mapping[str, str]) -> tuple[Any, Any]:
    protocol = settings.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf").strip().lower()
    # http/protobuf is the specification's default (package opentelemetry-exporter-otlp-proto-http);
    # grpc needs opentelemetry-exporter-otlp-proto-grpc. The SDK does not implement http/json.
    flavour = "grpc" if protocol == "grpc" else "http"
    traces = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{flavour}.trace_exporter")
    metrics = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{flavour}.metric_exporter")
    return traces.OTLPSpanExporter(), metrics.OTLPMetricExporter()


def _console_exporters() -> tuple[Any, Any]:
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    return ConsoleSpanExporter(), ConsoleMetricExporter()


def _sdk(exporters: tuple[Any, Any]) -> None:
    """Global SDK providers: spans batched, metrics read every OTEL_METRIC_EXPORT_INTERVAL (60 s)."""
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    span_exporter, metric_exporter = exporters
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
    resource = Resource.create(attributes)  # merges OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(
        MeterProvider(resource=resource, metric_readers=[PeriodicExportingMetricReader(metric_exporter)])
    )


def shutdown_telemetry() -> None:
    """Flush what the exporter dbfanout configured still holds (a graceful stop of ``dbfanout run``);
    no-op when dbfanout configured none (providers someone else set are theirs to flush)."""
    if _configured in (None, "none", "platform"):
        return
    from opentelemetry import metrics, trace

    for provider in (trace.get_tracer_provider(), metrics.get_meter_provider()):
        flush = getattr(provider, "force_flush", None)
        if callable(flush):
            try:
                flush()
            except Exception as exc:  # flushing is best effort at exit
                log.warning("telemetry flush failed", extra=ids(error=repr(exc)))
