"""From transfer payloads to :class:`IncomingMessage`, and from stored messages to deliveries."""

from __future__ import annotations

import struct
import uuid
from collections.abc import Iterable

from sbemulator.codec import (
    APP_PROPS,
    DATA,
    DELIVERY_ANN,
    HEADER,
    MESSAGE_ANN,
    PROPERTIES,
    CodecError,
    Section,
    _descriptor_code,
    compound_items,
    decode_value,
    enc_compound,
    enc_int,
    enc_long,
    enc_section,
    enc_str,
    enc_symbol,
    enc_timestamp,
    enc_uint,
    iter_values,
    map_get,
    skip_value,
    split_sections,
)
from sbemulator.entities import IncomingMessage, StoredMessage

SCHEDULED_TIME = "x-opt-scheduled-enqueue-time"
_STAMPED = {
    "x-opt-sequence-number",
    "x-opt-enqueued-time",
    "x-opt-locked-until",
    "x-opt-message-state",
    "x-opt-enqueue-sequence-number",
    "x-opt-deadletter-source",
}


def parse_transfer(payload: bytes) -> list[IncomingMessage]:
    """The messages in one transfer: a batch (format 0x80013700) yields one per data section.

    proton does not expose the message format, so a batch is recognised by shape: no header and
    no application properties, and every data section is itself an encoded message.
    """
    sections = split_sections(payload)
    inner = _batch_members(payload, sections)
    if inner is None:
        return [parse_message(payload, sections)]
    return [parse_message(m) for m in inner]


def _batch_members(payload: bytes, sections: list[Section]) -> list[bytes] | None:
    codes = {s.code for s in sections}
    if DATA not in codes or HEADER in codes or APP_PROPS in codes or not codes <= {DATA, MESSAGE_ANN, PROPERTIES}:
        return None
    members = []
    for s in sections:
        if s.code != DATA:
            continue
        body = _binary(payload, s.value_start)
        if len(body) < 3 or body[0] != 0 or body[1] != 0x53 or not 0x70 <= body[2] <= 0x78:
            return None
        try:
            split_sections(body)
        except CodecError:
            return None
        members.append(body)
    return members


def _binary(buf: bytes, pos: int) -> bytes:
    c = buf[pos]
    start = pos + (2 if c == 0xA0 else 5)
    return buf[start : skip_value(buf, pos)]


def parse_message(payload: bytes, sections: list[Section] | None = None) -> IncomingMessage:
    """Extract message-id, session id (group-id), ttl and scheduled enqueue time."""
    message_id = session_id = None
    ttl = scheduled = None
    for s in sections if sections is not None else split_sections(payload):
        if s.code == PROPERTIES:
            fields = [decode_value(payload, a)[0] for a, _ in iter_values(payload, s.value_start)]
            message_id = _id_text(fields[0] if fields else None)
            session_id = fields[10] if len(fields) > 10 and isinstance(fields[10], str) else None
        elif s.code == HEADER:
            fields = [decode_value(payload, a)[0] for a, _ in iter_values(payload, s.value_start)]
            ttl = fields[2] / 1000.0 if len(fields) > 2 and fields[2] else None
        elif s.code == MESSAGE_ANN:
            ms = map_get(payload, s.value_start, SCHEDULED_TIME)
            scheduled = ms / 1000.0 if isinstance(ms, int) else None
    return IncomingMessage(payload, message_id, session_id, ttl, scheduled)


def _id_text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


# Pre-encoded pieces of what render() stamps on every delivery (see _render_common).
_K_SEQ = enc_symbol("x-opt-sequence-number") + b"\x81"
_K_ENQUEUED = enc_symbol("x-opt-enqueued-time") + b"\x83"
_K_STATE = enc_symbol("x-opt-message-state") + b"\x71"
_K_LOCKED = enc_symbol("x-opt-locked-until") + b"\x83"
LOCK_TOKEN = "x-opt-lock-token"
_K_LOCK_TOKEN = enc_symbol(LOCK_TOKEN) + b"\x98"
_DELIVERY_ANN_LOCK_ONLY = bytes((0x00, 0x53, DELIVERY_ANN, 0xC1, len(_K_LOCK_TOKEN) + 17, 2)) + _K_LOCK_TOKEN
_ANNOTATIONS_MAP32 = bytes((0x00, 0x53, MESSAGE_ANN, 0xD1))
_HEADER_NO_FIELDS = enc_section(HEADER, enc_compound(0xD0, b"\x40" * 4 + enc_uint(0), 5))[:-4]
_pack_q, _pack_i, _pack_u = struct.Struct(">q").pack, struct.Struct(">i").pack, struct.Struct(">I").pack
_pack_size_count = struct.Struct(">II").pack


def render(msg: StoredMessage, locked_until: float | None) -> bytes:
    """The message as delivered: client sections plus broker header and annotations.

    A locked delivery (``locked_until`` set) carries its lock token in the delivery annotation
    ``x-opt-lock-token``, next to the delivery annotations the sender set, as the service does.
    """
    if (
        msg.dead_letter_source
        or msg.scheduled_at is not None
        or msg.dead_letter_reason is not None
        or msg.dead_letter_description is not None
    ):
        return _render_general(msg, locked_until)
    return _render_common(msg, locked_until)


def _render_common(msg: StoredMessage, locked_until: float | None) -> bytes:
    """render() for a message that is not dead-lettered or scheduled: one pass over the
    sections, stamps encoded from constants. Byte for byte what _render_general produces."""
    payload = msg.payload
    header, delivery_annotations, annotations, others = _scan(payload)
    if header is None:
        head = _HEADER_NO_FIELDS + _pack_u(msg.delivery_count)
    else:
        head = _header(payload, header, msg.delivery_count)
    if annotations is None or not compound_items(payload, annotations.value_start)[0]:
        stamps = [
            _K_SEQ,
            _pack_q(msg.seq),
            _K_ENQUEUED,
            _pack_q(round(msg.enqueued_at * 1000)),
            _K_STATE,
            _pack_i(int(msg.state)),
        ]
        if locked_until is not None:
            stamps += (_K_LOCKED, _pack_q(round(locked_until * 1000)))
        items = b"".join(stamps)
        ann = b"".join((_ANNOTATIONS_MAP32, _pack_size_count(len(items) + 4, len(stamps)), items))
    else:
        ann = _merged_map(MESSAGE_ANN, payload, annotations, _stamps(msg, locked_until), enc_symbol)
    token = msg.lock_token if locked_until is not None else None
    return b"".join((head, _delivery_annotations(payload, delivery_annotations, token), ann, *others))


def _delivery_annotations(payload: bytes, section: Section | None, token: uuid.UUID | None) -> bytes:
    """The sender's delivery annotations plus ``x-opt-lock-token``; empty ones are left out."""
    if section is None or not compound_items(payload, section.value_start)[0]:
        return b"" if token is None else _DELIVERY_ANN_LOCK_ONLY + token.bytes
    extra = [] if token is None else [(LOCK_TOKEN, b"\x98" + token.bytes)]
    return _merged_map(DELIVERY_ANN, payload, section, extra, enc_symbol)


def _scan(payload: bytes) -> tuple[Section | None, Section | None, Section | None, list[bytes]]:
    """The header, delivery annotations and message annotations sections, and the bytes of the
    sections delivered unchanged, merged into one slice when contiguous."""
    header = delivery_annotations = annotations = None
    start = end = -1  # the run of unchanged sections being collected
    others: list[bytes] = []
    pos, n = 0, len(payload)
    try:
        while pos < n:
            if payload[pos] != 0x00:
                raise CodecError("message section is not a described type")
            if payload[pos + 1] == 0x53:  # smallulong descriptor: the common encoding
                code, value = payload[pos + 2], pos + 3
            else:
                code, value = _descriptor_code(payload, pos + 1), skip_value(payload, pos + 1)
            section_end = skip_value(payload, value)
            if code == HEADER:
                header = Section(code, pos, value, section_end)
            elif code == MESSAGE_ANN:
                annotations = Section(code, pos, value, section_end)
            elif code == DELIVERY_ANN:
                delivery_annotations = Section(code, pos, value, section_end)
            else:
                if pos != end:
                    if start >= 0:
                        others.append(payload[start:end])
                    start = pos
                end = section_end
            pos = section_end
    except IndexError as exc:
        raise CodecError("truncated AMQP message") from exc
    if start >= 0:
        others.append(payload[start:end])
    return header, delivery_annotations, annotations, others


def _stamps(msg: StoredMessage, locked_until: float | None) -> list[tuple[str, bytes]]:
    stamps = [
        ("x-opt-sequence-number", enc_long(msg.seq)),
        ("x-opt-enqueued-time", enc_timestamp(msg.enqueued_at)),
        ("x-opt-message-state", enc_int(int(msg.state))),
    ]
    if locked_until is not None:
        stamps.append(("x-opt-locked-until", enc_timestamp(locked_until)))
    if msg.dead_letter_source:
        stamps.append(("x-opt-deadletter-source", enc_str(msg.dead_letter_source)))
    if msg.scheduled_at is not None:
        stamps.append((SCHEDULED_TIME, enc_timestamp(msg.scheduled_at)))
    return stamps


def _render_general(msg: StoredMessage, locked_until: float | None) -> bytes:
    """render() for any message (dead-lettered, scheduled, ...)."""
    payload = msg.payload
    sections = split_sections(payload)
    header = next((s for s in sections if s.code == HEADER), None)
    stamps = _stamps(msg, locked_until)
    parts = [_header(payload, header, msg.delivery_count)]
    delivery_annotations = next((s for s in sections if s.code == DELIVERY_ANN), None)
    parts.append(_delivery_annotations(payload, delivery_annotations, msg.lock_token if locked_until else None))
    annotations = next((s for s in sections if s.code == MESSAGE_ANN), None)
    parts.append(_merged_map(MESSAGE_ANN, payload, annotations, stamps, enc_symbol))
    dead_letter = msg.dead_letter_reason is not None or msg.dead_letter_description is not None
    for s in sections:
        if s.code in (HEADER, DELIVERY_ANN, MESSAGE_ANN):
            continue
        if s.code == APP_PROPS and dead_letter:
            continue
        if s.code > APP_PROPS and dead_letter:
            parts.append(_dead_letter_props(payload, sections, msg))
            dead_letter = False
        parts.append(payload[s.start : s.end])
    if dead_letter:
        parts.append(_dead_letter_props(payload, sections, msg))
    return b"".join(parts)


def _header(buf: bytes, section: Section | None, delivery_count: int) -> bytes:
    fields = [b"\x40"] * 5
    if section is not None:
        for i, (a, b) in enumerate(iter_values(buf, section.value_start)):
            if i < 5:
                fields[i] = buf[a:b]
    fields[4] = enc_uint(delivery_count)
    return enc_section(HEADER, enc_compound(0xD0, b"".join(fields), 5))


def _merged_map(
    code: int,
    buf: bytes,
    section: Section | None,
    extra: Iterable[tuple[str, bytes]],
    key_encoder: object,
) -> bytes:
    extra = list(extra)
    replaced = {k for k, _ in extra} | (_STAMPED if code == MESSAGE_ANN else set())
    items: list[bytes] = []
    count = 0
    if section is not None and compound_items(buf, section.value_start)[0]:
        it = iter_values(buf, section.value_start)
        for k_start, _ in it:
            _, v_end = next(it)
            if decode_value(buf, k_start)[0] in replaced:
                continue
            items.append(buf[k_start:v_end])
            count += 2
    assert callable(key_encoder)
    for key, value in extra:
        items.append(key_encoder(key) + value)
        count += 2
    return enc_section(code, enc_compound(0xD1, b"".join(items), count))


def _dead_letter_props(buf: bytes, sections: list[Section], msg: StoredMessage) -> bytes:
    props = next((s for s in sections if s.code == APP_PROPS), None)
    extra = []
    if msg.dead_letter_reason is not None:
        extra.append(("DeadLetterReason", enc_str(msg.dead_letter_reason)))
    if msg.dead_letter_description is not None:
        extra.append(("DeadLetterErrorDescription", enc_str(msg.dead_letter_description)))
    return _merged_map(APP_PROPS, buf, props, extra, enc_str)
