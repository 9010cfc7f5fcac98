"""``function_app.py`` configures telemetry export from the settings, and nothing without them (issue 24).

Each case imports the app in a fresh interpreter (the OpenTelemetry global providers can be set
once per process) and reports which providers and exporters are in effect.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.otel_setup import chosen_exporter

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys
sys.path.insert(0, {repo!r})
import function_app  # noqa: F401  (configures telemetry at import, as on Azure)
from opentelemetry import metrics, trace
from shared import otel_setup
PACKAGES = ("azure.monitor", "opentelemetry.exporter", "opentelemetry.sdk")
tp, mp = trace.get_tracer_provider(), metrics.get_meter_provider()
exporters = []
for proc in getattr(getattr(tp, "_active_span_processor", None), "_span_processors", ()):
    batch = getattr(proc, "_batch_processor", None)
    exporter = getattr(proc, "span_exporter", None) or getattr(batch, "_exporter", None)
    exporters.append(type(exporter).__name__)
readers = [type(getattr(r, "_exporter", r)).__name__ for r in getattr(mp, "_metric_readers", ())]
resource = getattr(tp, "resource", None)
print(json.dumps({{
    "chosen": otel_setup._configured,
    "tracer_provider": type(tp).__name__,
    "meter_provider": type(mp).__name__,
    "span_exporters": exporters,
    "metric_exporters": readers,
    "service": (resource.attributes.get("service.name") if resource is not None else None),
    "modules": sorted(m for m in sys.modules if m.startswith(PACKAGES)),
}}))
"""

CLEAN = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("OTEL_", "APPLICATIONINSIGHTS_", "PYTHON_APPLICATIONINSIGHTS"))
}


def _probe(tmp_path: Path, **env: str) -> dict[str, object]:
    config = tmp_path / "dbfanout.toml"
    config.write_text((REPO / "dbfanout.toml.sample").read_text())
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(repo=str(REPO))],
        env={**CLEAN, "DBFANOUT_CONFIG": str(config), "ORDERS_DB_URL": "sqlite://", **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_nothing_is_configured_or_imported_when_nothing_is_set(tmp_path: Path) -> None:
    seen = _probe(tmp_path)
    assert seen["chosen"] == "none"
    assert seen["tracer_provider"] == "ProxyTracerProvider" and seen["meter_provider"] == "_ProxyMeterProvider"
    assert seen["modules"] == []  # no SDK, no exporter package imported


def test_otlp_when_the_endpoint_is_set_honouring_the_service_name(tmp_path: Path) -> None:
    seen = _probe(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4318", OTEL_SERVICE_NAME="shop-dbfanout")
    assert seen["chosen"] == "otlp"
    assert seen["span_exporters"] == ["OTLPSpanExporter"] and seen["metric_exporters"] == ["OTLPMetricExporter"]
    assert "opentelemetry.exporter.otlp.proto.http.trace_exporter" in seen["modules"]  # type: ignore[operator]
    assert seen["service"] == "shop-dbfanout"


def test_azure_monitor_when_the_connection_string_is_set_with_entra_auth(tmp_path: Path) -> None:
    seen = _probe(
        tmp_path,
        APPLICATIONINSIGHTS_CONNECTION_STRING="InstrumentationKey=00000000-0000-0000-0000-000000000000;"
        "IngestionEndpoint=http://127.0.0.1:9/",
        APPLICATIONINSIGHTS_AUTHENTICATION_STRING="ClientId=11111111-1111-1111-1111-111111111111;Authorization=AAD",
    )
    assert seen["chosen"] == "azure-monitor"
    assert seen["tracer_provider"] == "TracerProvider" and seen["meter_provider"] == "MeterProvider"
    assert "AzureMonitorTraceExporter" in seen["span_exporters"]  # type: ignore[operator]
    assert seen["service"] == "dbfanout"


def test_the_platform_worker_owns_the_export_when_its_telemetry_is_on(tmp_path: Path) -> None:
    seen = _probe(
        tmp_path,
        PYTHON_APPLICATIONINSIGHTS_ENABLE_TELEMETRY="true",
        APPLICATIONINSIGHTS_CONNECTION_STRING="InstrumentationKey=00000000-0000-0000-0000-000000000000",
    )
    assert seen["chosen"] == "platform" and seen["tracer_provider"] == "ProxyTracerProvider"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "none"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, "otlp"),
        ({"APPLICATIONINSIGHTS_CONNECTION_STRING": "x", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, "azure-monitor"),
        (
            {"PYTHON_APPLICATIONINSIGHTS_ENABLE_TELEMETRY": "TRUE", "APPLICATIONINSIGHTS_CONNECTION_STRING": "x"},
            "platform",
        ),
    ],
)
def test_the_settings_choose_one_exporter(env: dict[str, str], expected: str) -> None:
    assert chosen_exporter(env) == expected


def test_dbfanout_run_otel_console_prints_spans() -> None:
    # What `dbfanout run --otel console` configures before the app loads: spans printed on stdout
    code = (
        "from shared.otel_setup import configure_telemetry, shutdown_telemetry\n"
        "assert configure_telemetry(override='console') == 'console'\n"
        "assert configure_telemetry() == 'console'  # the app's own call keeps the CLI's choice\n"
        "from shared.tracing import send_span\n"
        "with send_span('orders', 'orders-changes', 'b-1', 3): pass\n"
        "shutdown_telemetry()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env={**CLEAN, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert '"name": "dbfanout.send"' in done.stdout and '"dbfanout.poller": "orders"' in done.stdout
