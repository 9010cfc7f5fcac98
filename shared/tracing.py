"""Traces across the queue: W3C trace context from the poller's send span to the worker's span.

The poller stamps each message with the context of the span that sent its page: in the envelope
(``traceparent``, the only carrier a storage queue has) and, on Service Bus, in the
``traceparent`` and ``Diagnostic-Id`` application properties (what the Functions host and the
Azure SDKs read). The worker continues that trace. Through the OpenTelemetry API only: without
an SDK every span is a no-op and nothing is stamped.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.scrub import describe_error, scrub

__all__ = [
    "PROP_DIAGNOSTIC_ID",
    "PROP_TRACEPARENT",
    "current_traceparent",
    "delivery_span",
    "messaging_system",
    "record_failure",
    "send_span",
    "tracer",
]

PROP_TRACEPARENT = "traceparent"
PROP_DIAGNOSTIC_ID = "Diagnostic-Id"

tracer = trace.get_tracer("dbfanout")
_PROPAGATOR = TraceContextTextMapPropagator()


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span; None when there is no recording span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get(PROP_TRACEPARENT)


def _remote_context(traceparent: str | None) -> trace.SpanContext | None:
    if not traceparent:
        return None
    ctx = _PROPAGATOR.extract({PROP_TRACEPARENT: traceparent})
    span_context = trace.get_current_span(ctx).get_span_context()
    return span_context if span_context.is_valid else None


def record_failure(span: Span, error: BaseException) -> None:
    """Mark the span failed with the exception, scrubbed (``Span.record_exception`` would export the
    raw message and traceback)."""
    text = describe_error(error)
    span.set_status(Status(StatusCode.ERROR, text))
    stack = scrub("".join(traceback.format_exception(error)))
    span.add_event(
        "exception",
        {"exception.type": type(error).__name__, "exception.message": text, "exception.stacktrace": stack},
    )


@contextmanager
def send_span(
    poller: str, destination: str, batch_id: str, events: int, *, transport: str = "servicebus"
) -> Iterator[Span]:
    """The poller's span around sending one page (a producer span)."""
    attributes = {
        "messaging.system": messaging_system(transport),
        "messaging.operation": "publish",
        "messaging.destination.name": destination,
        "dbfanout.poller": poller,
        "dbfanout.batch_id": batch_id,
        "dbfanout.events": events,
    }
    with _failing(tracer.start_as_current_span("dbfanout.send", kind=SpanKind.PRODUCER, **_quiet(attributes))) as span:
        yield span


@contextmanager
def delivery_span(
    properties: Mapping[str, Any], envelope_traceparent: str | None, attributes: Mapping[str, Any]
) -> Iterator[Span]:
    """The worker's span for one delivery, continuing the sender's trace.

    The sender's context comes from the ``traceparent`` (or ``Diagnostic-Id``) property, else from
    the envelope. When the host already runs the invocation in a span (Azure Functions with
    OpenTelemetry on, itself a child of the message's context), this span is its child and links
    the sender's span; otherwise the sender's span is its parent.
    """
    header = properties.get(PROP_TRACEPARENT) or properties.get(PROP_DIAGNOSTIC_ID) or envelope_traceparent
    remote = _remote_context(str(header) if header else None)
    current = trace.get_current_span().get_span_context()
    parent: otel_context.Context | None = None
    links: list[Link] = []
    if remote is not None and not current.is_valid:
        parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    elif remote is not None:
        links.append(Link(remote))
    span_cm = tracer.start_as_current_span(
        "dbfanout.deliver", context=parent, kind=SpanKind.CONSUMER, links=links, **_quiet(dict(attributes))
    )
    with _failing(span_cm) as span:
        yield span


def messaging_system(transport: str) -> str:
    """The semantic-convention ``messaging.system`` of a poller's transport."""
    return "azure_storage_queue" if transport == "storage-queue" else "servicebus"


def _quiet(attributes: dict[str, Any]) -> dict[str, Any]:
    """Span options: our attributes, and no raw exception recording (record_failure scrubs it)."""
    return {
        "attributes": {k: v for k, v in attributes.items() if v is not None},
        "record_exception": False,
        "set_status_on_exception": False,
    }


@contextmanager
def _failing(span_cm: Any) -> Iterator[Span]:
    with span_cm as span:
        try:
            yield span
        except Exception as exc:
            record_failure(span, exc)
            raise
