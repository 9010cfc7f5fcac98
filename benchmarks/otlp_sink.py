"""A local OTLP/HTTP endpoint that accepts and discards what it receives (benchmarks only).

Tracing "on" in a benchmark means the real SDK and the real OTLP/HTTP exporter, configured the way
``shared.otel_setup`` configures them from ``OTEL_EXPORTER_OTLP_ENDPOINT``, sending to this sink:
the cost measured is dbfanout's spans and metrics plus the exporter's, not a collector's.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["OtlpSink"]


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.server.received[self.path] = self.server.received.get(self.path, 0) + 1  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return None


class OtlpSink:
    """``with OtlpSink() as sink: env["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.endpoint``."""

    def __init__(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.received = {}  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def received(self) -> dict[str, int]:
        """Requests per path (``/v1/traces``, ``/v1/metrics``): proof the exporter was on."""
        return dict(self._server.received)  # type: ignore[attr-defined]

    def __enter__(self) -> OtlpSink:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()
