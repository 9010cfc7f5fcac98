"""SDK messages → ``azure.functions`` ServiceBusMessage objects, filled like the host fills them.

The one conversion that matters: the AMQP header (and so the Python SDK) counts *prior*
deliveries (0 on the first one) while the Functions host passes the .NET SDK's count, 1 on
the first delivery. The local host adds one, so code sees the numbers it will see on Azure.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from azure.functions.meta import Datum
from azure.functions.servicebus import ServiceBusMessage as FunctionsMessage
from azure.servicebus import ServiceBusReceivedMessage

from shared.codec import dumps

__all__ = ["body_bytes", "to_functions_message"]


def _text(value: Any) -> Any:
    return value.decode("utf-8", "replace") if isinstance(value, bytes | bytearray) else value


def _str_or_none(value: Any) -> str | None:
    value = _text(value)
    return None if value is None else str(value)


def body_bytes(msg: ServiceBusReceivedMessage) -> bytes:
    """The payload as bytes: data sections joined; an AMQP value or sequence body as JSON."""
    body = msg.body
    if isinstance(body, bytes | bytearray):
        return bytes(body)
    if isinstance(body, str):
        return body.encode()
    if isinstance(body, Iterable) and not isinstance(body, Mapping):
        parts = list(body)
        if all(isinstance(p, bytes | bytearray) for p in parts):
            return b"".join(bytes(p) for p in parts)
        return dumps(parts)
    return dumps(body)


def _datum(value: Any) -> Datum:
    """Trigger metadata travels as typed Datums, as the Python worker hands them over."""
    if isinstance(value, bool | dict | list):
        return Datum(dumps(value).decode(), "json")
    if isinstance(value, int):
        return Datum(value, "int")
    if isinstance(value, dt.datetime):
        return Datum(value.isoformat(), "string")
    return Datum(str(value), "string")


def _properties(msg: ServiceBusReceivedMessage) -> dict[str, Any]:
    return {str(_text(k)): _text(v) for k, v in (msg.application_properties or {}).items()}


# .NET reports a message without a time-to-live as expiring at DateTimeOffset.MaxValue.
_NEVER = dt.datetime.max.replace(tzinfo=dt.UTC)


def to_functions_message(msg: ServiceBusReceivedMessage) -> FunctionsMessage:
    """Build the object a ``service_bus_queue_trigger`` function receives on Azure."""
    props = _properties(msg)
    expires = msg.expires_at_utc or (_NEVER if msg.enqueued_time_utc else None)
    delivery_count = (msg.delivery_count or 0) + 1  # Functions count from 1 (see module doc)
    message_id = _str_or_none(msg.message_id) or ""
    lock_token = _str_or_none(msg.lock_token)
    metadata: dict[str, Any] = {
        "MessageId": message_id,
        "DeliveryCount": delivery_count,
        "EnqueuedTimeUtc": msg.enqueued_time_utc,
        "SequenceNumber": msg.sequence_number,
        "ContentType": _str_or_none(msg.content_type),
        "CorrelationId": _str_or_none(msg.correlation_id),
        "Label": _str_or_none(msg.subject),
        "Subject": _str_or_none(msg.subject),
        "LockToken": lock_token,
        "ExpiresAtUtc": expires,
        "ApplicationProperties": props,
        "UserProperties": props,
    }
    datums = {k: _datum(v) for k, v in metadata.items() if v is not None}
    return FunctionsMessage(
        body=body_bytes(msg),
        trigger_metadata=datums,
        application_properties=props,
        user_properties=dict(props),
        content_type=_str_or_none(msg.content_type),
        correlation_id=_str_or_none(msg.correlation_id),
        dead_letter_error_description=_str_or_none(msg.dead_letter_error_description),
        dead_letter_reason=_str_or_none(msg.dead_letter_reason),
        dead_letter_source=_str_or_none(msg.dead_letter_source),
        delivery_count=delivery_count,
        enqueued_sequence_number=msg.enqueued_sequence_number,
        enqueued_time_utc=msg.enqueued_time_utc,
        expires_at_utc=expires,
        label=_str_or_none(msg.subject),
        locked_until=msg.locked_until_utc,
        lock_token=lock_token,
        message_id=message_id,
        partition_key=_str_or_none(msg.partition_key),
        reply_to=_str_or_none(msg.reply_to),
        reply_to_session_id=_str_or_none(msg.reply_to_session_id),
        scheduled_enqueue_time_utc=msg.scheduled_enqueue_time_utc,
        sequence_number=msg.sequence_number,
        session_id=_str_or_none(msg.session_id),
        state=int(msg.state) if msg.state is not None else None,
        subject=_str_or_none(msg.subject),
        time_to_live=msg.time_to_live,
        to=_str_or_none(msg.to),
        transaction_partition_key=None,
    )
