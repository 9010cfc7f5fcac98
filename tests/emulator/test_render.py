"""The delivery encoder's fast path produces exactly the bytes of the general one."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from proton import Message, symbol

from sbemulator.codec import DATA, DELIVERY_ANN, HEADER, MESSAGE_ANN, PROPERTIES, enc_compound, enc_str, enc_symbol
from sbemulator.entities import MessageState, StoredMessage
from sbemulator.messages import _render_common, _render_general, render

NOW = 1_700_000_000.123


def _encoded(**kw: object) -> bytes:
    return bytes(Message(**kw).encode())  # type: ignore[arg-type]


def _section(code: int, value: bytes, *, long_descriptor: bool = False) -> bytes:
    if long_descriptor:  # the same section with a ulong descriptor instead of smallulong
        return b"\x00\x80" + code.to_bytes(8, "big") + value
    return bytes((0x00, 0x53, code)) + value


_DATA = _section(DATA, b"\xa0\x03abc")
_PROPS = _section(PROPERTIES, enc_compound(0xD0, enc_str("id-1"), 1))
_ANNOTATIONS = _section(
    MESSAGE_ANN,
    enc_compound(
        0xD1, enc_symbol("x-opt-partition-key") + enc_str("p") + enc_symbol("x-opt-sequence-number") + b"\x44", 4
    ),
)

PAYLOADS = {
    "body only": _encoded(body=b"x" * 1024),
    "properties and app properties": _encoded(
        body=b"y" * 10, id="m1", subject="s", correlation_id="c", properties={"a": 1, "b": "two"}
    ),
    "header with ttl": _encoded(body=b"z", ttl=30, durable=True, priority=7),
    "annotations": _encoded(body=b"z", annotations={symbol("x-opt-partition-key"): "p1"}),
    "empty annotations": _encoded(body=b"z", annotations={}),
    "amqp-value body": _encoded(body={"k": [1, 2, 3]}),
    "sessions": _encoded(body=b"s", group_id="session-1", id="m2"),
    "long descriptors": _section(PROPERTIES, enc_compound(0xD0, enc_str("id"), 1), long_descriptor=True)
    + _section(DATA, b"\xa0\x01q", long_descriptor=True),
    "sections out of order": _PROPS + _ANNOTATIONS + _DATA,
    "empty delivery annotations": _section(DELIVERY_ANN, enc_compound(0xD1, b"", 0)) + _PROPS + _DATA,
    "delivery annotations": _section(DELIVERY_ANN, enc_compound(0xD1, enc_symbol("x-k") + enc_str("v"), 2)) + _DATA,
    "header after properties": _PROPS + _section(HEADER, enc_compound(0xD0, b"\x41", 1)) + _DATA,
    "no sections": b"",
}


@pytest.mark.parametrize("payload", list(PAYLOADS.values()), ids=list(PAYLOADS))
@pytest.mark.parametrize("locked_until", [NOW + 60, None])
@pytest.mark.parametrize("delivery_count", [0, 3])
def test_fast_render_matches_general_render(payload: bytes, locked_until: float | None, delivery_count: int):
    msg = StoredMessage(
        seq=42, payload=payload, message_id=None, session_id=None, enqueued_at=NOW, expires_at=NOW + 3600
    )
    msg.delivery_count = delivery_count
    msg.lock_token = uuid.UUID(int=12345)
    for state in MessageState:
        msg.state = state
        assert _render_common(msg, locked_until) == _render_general(msg, locked_until)
        assert render(msg, locked_until) == _render_general(msg, locked_until)


def test_dead_lettered_and_scheduled_messages_take_the_general_path():
    msg = StoredMessage(
        seq=7, payload=PAYLOADS["properties and app properties"], message_id=None, session_id=None,
        enqueued_at=NOW, expires_at=NOW + 3600,
    )  # fmt: skip
    msg.dead_letter_reason, msg.dead_letter_description, msg.dead_letter_source = "Why", "Because", "q"
    rendered = render(msg, None)
    assert rendered == _render_general(msg, None)
    decoded = Message()
    decoded.decode(rendered)
    properties: Any = decoded.properties
    annotations: Any = decoded.annotations
    assert properties["DeadLetterReason"] == "Why"
    assert annotations[symbol("x-opt-deadletter-source")] == "q"
    scheduled = StoredMessage(
        seq=8, payload=PAYLOADS["body only"], message_id=None, session_id=None, enqueued_at=NOW,
        expires_at=NOW + 3600, scheduled_at=NOW + 5,
    )  # fmt: skip
    assert render(scheduled, None) == _render_general(scheduled, None)


def test_locked_delivery_carries_the_lock_token_delivery_annotation_next_to_the_senders():
    msg = StoredMessage(
        seq=9, payload=PAYLOADS["delivery annotations"], message_id=None, session_id=None, enqueued_at=NOW,
        expires_at=NOW + 3600, lock_token=uuid.UUID(int=7),
    )  # fmt: skip
    decoded = Message()
    decoded.decode(render(msg, NOW + 60))
    assert dict(decoded.instructions or {}) == {symbol("x-k"): "v", symbol("x-opt-lock-token"): uuid.UUID(int=7)}
    decoded.decode(render(msg, None))  # peeked: no lock, no token
    assert dict(decoded.instructions or {}) == {symbol("x-k"): "v"}
