"""Batch → queue messages: packing under the size limit, idempotency keys, properties (pure).

Used by the poller's sinks (Service Bus and Storage Queue) and by the worker when it splits a
failing message, so both build messages exactly the same way.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any, Protocol, runtime_checkable

from shared.codec import dumps, encode_event, envelope_header
from shared.errors import OversizeRowError
from shared.ids import idempotency_key
from shared.models import BATCH_SCHEMA, Batch, RowChange

__all__ = [
    "CONTENT_TYPE",
    "PROP_EVENT_COUNT",
    "PROP_POLLER",
    "PROP_SCHEMA",
    "PROP_TABLES",
    "OutgoingMessage",
    "PreEncoded",
    "pack_batch",
    "session_key",
]

CONTENT_TYPE = "application/json"
PROP_SCHEMA = "dbfanout-schema"
PROP_POLLER = "dbfanout-poller"
PROP_EVENT_COUNT = "dbfanout-event-count"
PROP_BATCH_ID = "dbfanout-batch-id"
# The tables the message's batch came from, comma-separated and framed by commas
# (``,public.orders,public.order_lines,``) so a subscription filter matches one exactly:
# ``[dbfanout-tables] LIKE '%,public.orders,%'``. Absent when no event names a table (a query).
PROP_TABLES = "dbfanout-tables"

# Room left for AMQP framing, system and application properties inside the entity's limit.
PROPERTY_ALLOWANCE = 4 * 1024


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    """One message ready to send: body, idempotency key and properties."""

    message_id: str
    body: bytes
    subject: str
    event_ids: tuple[str, ...]
    application_properties: Mapping[str, str | int] = field(default_factory=dict)
    content_type: str = CONTENT_TYPE
    session_id: str | None = None


def _header(batch: Batch) -> bytes:
    """The envelope without its events: ``{"schema":...,"events":[`` ... ``]}``."""
    head = dumps(envelope_header(batch))
    return head[:-2]  # strip the closing "]}"


def _message(batch: Batch, head: bytes, encoded: list[bytes], event_ids: list[str]) -> OutgoingMessage:
    return _message_of(batch, head + b",".join(encoded) + b"]}", event_ids)


def _message_of(batch: Batch, body: bytes, event_ids: list[str]) -> OutgoingMessage:
    return OutgoingMessage(
        message_id=idempotency_key(batch.poller, batch.source_fingerprint, event_ids),
        body=body,
        subject=batch.poller,
        event_ids=tuple(event_ids),
        application_properties={
            PROP_SCHEMA: BATCH_SCHEMA,
            PROP_POLLER: batch.poller,
            PROP_EVENT_COUNT: len(event_ids),
            PROP_BATCH_ID: batch.batch_id,
        },
    )


# Every event's id, and either its encode_event form or its JSON (exactly the bytes dumps writes).
EncodedEvents = tuple[list[str], list[dict[str, Any]] | list[bytes]]


@runtime_checkable
class PreEncoded(Protocol):
    """Events that hand over their ids and encoded forms without being built (the poller's pages)."""

    def encoded(self) -> EncodedEvents | None:
        """Every event's id and its ``encode_event`` form or JSON bytes, in order; None when it cannot."""
        ...


def _encoded_events(events: Sequence[RowChange]) -> EncodedEvents:
    """Each event's id and :func:`encode_event` form: straight from the page when it can."""
    pre = events.encoded() if isinstance(events, PreEncoded) else None
    if pre is not None:
        return pre
    return [e.event_id for e in events], [encode_event(e) for e in events]


def pack_batch(
    batch: Batch,
    max_message_bytes: int,
    *,
    oversize: Callable[[RowChange, int], RowChange] | None = None,
    max_events: int | None = None,
) -> list[OutgoingMessage]:
    """Pack a batch's events, in order, into as few messages as fit under the limit.

    A single event that cannot fit is passed to ``oversize`` (the claim-check hook, which
    returns a small reference event) or raises :class:`OversizeRowError` naming poller and pk.
    The same batch always packs into the same messages with the same ids.
    """
    messages = _pack(batch, max_message_bytes, oversize, max_events)
    tables = batch_tables(batch.events)
    if tables is None or not messages:
        return messages
    return [replace(m, application_properties={**m.application_properties, PROP_TABLES: tables}) for m in messages]


def batch_tables(events: Sequence[RowChange]) -> str | None:
    """The :data:`PROP_TABLES` value of a batch's events (None: no event names a table).

    A page's events say which tables they hold without being built when they can (a keyset
    page's one table); otherwise each event's ``table`` is read.
    """
    known = getattr(events, "tables", None)
    names = sorted(known if known is not None else {e.table for e in events if e.table is not None})
    return "," + ",".join(names) + "," if names else None


def _pack(
    batch: Batch,
    max_message_bytes: int,
    oversize: Callable[[RowChange, int], RowChange] | None,
    max_events: int | None,
) -> list[OutgoingMessage]:
    budget = max_message_bytes - PROPERTY_ALLOWANCE
    head = _header(batch)
    event_ids, encoded_events = _encoded_events(batch.events)
    if not encoded_events:
        return []
    if isinstance(encoded_events[0], bytes):  # each event's JSON
        raws: list[bytes] = encoded_events
        if max_events is None and (packed := _pack_raw(batch, head, budget, event_ids, raws)) is not None:
            return packed
        return _pack_one_by_one(batch, head, budget, event_ids, raws.__getitem__, 0, [], oversize, max_events)
    docs: list[dict[str, Any]] = encoded_events
    messages: list[OutgoingMessage] = []
    start = 0
    if max_events is None:
        start = _pack_in_chunks(batch, head, budget, event_ids, docs, messages)
    if start == len(docs):
        return messages
    return _pack_one_by_one(
        batch, head, budget, event_ids, lambda index: dumps(docs[index]), start, messages, oversize, max_events
    )


def _pack_one_by_one(
    batch: Batch,
    head: bytes,
    budget: int,
    event_ids: list[str],
    raw_at: Callable[[int], bytes],
    start: int,
    messages: list[OutgoingMessage],
    oversize: Callable[[RowChange, int], RowChange] | None,
    max_events: int | None,
) -> list[OutgoingMessage]:
    """The reference packing, event by event from ``start``: every other path splits where this does."""
    max_message_bytes = budget + PROPERTY_ALLOWANCE
    encoded: list[bytes] = []
    ids: list[str] = []
    size = len(head) + 2
    for index in range(start, len(event_ids)):
        event_id, raw = event_ids[index], raw_at(index)
        if len(head) + len(raw) + 2 > budget:
            event = batch.events[index]
            if oversize is None:
                raise OversizeRowError(
                    f"poller {batch.poller}: row {dict(event.pk)} encodes to {len(raw)} bytes, more than the "
                    f"{max_message_bytes}-byte message limit"
                )
            event = oversize(event, len(raw))
            event_id, raw = event.event_id, dumps(encode_event(event))
        if ids and (size + len(raw) + 1 > budget or (max_events is not None and len(ids) >= max_events)):
            messages.append(_message(batch, head, encoded, ids))
            encoded, ids, size = [], [], len(head) + 2
        encoded.append(raw)
        ids.append(event_id)
        size += len(raw) + 1
    if ids:
        messages.append(_message(batch, head, encoded, ids))
    return messages


def _pack_raw(
    batch: Batch, head: bytes, budget: int, event_ids: list[str], raws: list[bytes]
) -> list[OutgoingMessage] | None:
    """Pack events given as JSON where the event-by-event loop would split, without it: the
    sizes' running sums say where each message ends (a message takes events while ``head + 2 +
    sum(size + 1)`` stays within the budget, and at least one). None when an event is too big for
    a message alone (the loop's claim-check or error decides)."""
    room = budget - len(head) - 2
    sizes = list(map(len, raws))
    if max(sizes) > room:
        return None
    ends = list(accumulate(map((1).__add__, sizes), initial=0))  # ends[k]: bytes of the first k events and commas
    out: list[OutgoingMessage] = []
    start, count = 0, len(raws)
    while start < count:
        stop = max(start + 1, min(count, bisect_right(ends, ends[start] + room) - 1))
        parts = raws[start:stop]
        parts[0] = head + parts[0]  # the body in one join: it is often hundreds of KiB, and a large
        parts[-1] += b"]}"  # temporary costs fresh pages
        out.append(_message_of(batch, b",".join(parts), event_ids[start:stop]))
        start = stop
    return out


def _pack_in_chunks(
    batch: Batch, head: bytes, budget: int, event_ids: list[str], docs: list[dict[str, Any]], out: list[OutgoingMessage]
) -> int:
    """Pack messages exactly where the event-by-event loop of :func:`pack_batch` would split, with
    one encoder call per message instead of one per event; returns where that loop must go on
    (at an event too big for a message alone, or the end).

    The loop counts ``head + 2`` and then each event and a comma; a list ``[e1,...,ek]`` encodes
    to exactly ``sum(len(ei)) + k + 1`` bytes, so a chunk's size is ``head + len(chunk) + 1``. The
    first chunk's length guesses the next ones; a few single events correct the guess either way.
    """
    start, count, room = 0, len(docs), budget - len(head) - 2
    per_event = 0.0  # bytes an event and its comma take, from the first chunk

    def too_big(raw_size: int) -> bool:  # alone over the limit: the loop (claim-check or error) decides
        return raw_size > room

    while start < count:
        take = count - start if not per_event else max(1, min(count - start, int(room / per_event)))
        chunk = dumps(docs[start : start + take])
        per_event = per_event or (len(chunk) - 1) / take
        while len(chunk) - 1 > room and take > 1 and len(chunk) - 1 > room + 2 * per_event:  # far off: guess again
            take = max(1, int(take * room / (len(chunk) - 1)))
            chunk = dumps(docs[start : start + take])
        size, end = len(head) + len(chunk) + 1, len(chunk) - 1  # the inside ends before the "]"
        while size > budget and take > 1:  # one event too many: drop it (it starts the next message)
            dropped = len(dumps(docs[start + take - 1]))
            if too_big(dropped):
                return start
            take, size, end = take - 1, size - dropped - 1, end - dropped - 1
        if size > budget:
            return start
        extra: list[bytes] = []
        while start + take < count:  # room for more: add single events while they fit
            raw = dumps(docs[start + take])
            if too_big(len(raw)):
                return start
            if size + len(raw) + 1 > budget:
                break
            extra.append(raw)
            take, size = take + 1, size + len(raw) + 1
        out.append(_message(batch, head, [chunk[1:end], *extra], event_ids[start : start + take]))
        start += take
    return start


def session_key(pk_columns: tuple[str, ...], event: RowChange) -> str:
    """Session id for per-key ordering: the primary key values (Service Bus allows 128 chars).

    Change-log events (outbox, logical decoding) carry their own key (``{"aggregate": ...}``),
    not the configured pk columns: their session is that key.
    """
    names = [k for k in pk_columns if k in event.pk] or list(event.pk)
    return "|".join(f"{k}={event.pk.get(k)}" for k in names)[:128]
