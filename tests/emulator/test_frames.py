"""The delivery-id sequencer: transfers renumbered into proton's order, whatever the read sizes."""

from __future__ import annotations

import struct

import pytest

from sbemulator.codec import compound_items, decode_value, skip_value
from sbemulator.frames import DeliveryIdSequencer

HEADER = b"AMQP\x00\x01\x00\x00"


def _uint(v: int) -> bytes:
    return b"\x43" if v == 0 else bytes((0x52, v)) if v < 256 else b"\x70" + struct.pack(">I", v)


def _transfer(channel: int, delivery_id: int | None, payload: bytes, *, more: bool = False) -> bytes:
    did = b"\x40" if delivery_id is None else _uint(delivery_id)
    fields = b"\x43" + did + b"\xa0\x01t" + b"\x43" + b"\x42" + (b"\x41" if more else b"\x42")
    perf = b"\x00\x53\x14" + bytes((0xC0, len(fields) + 1, 6)) + fields
    return struct.pack(">IBBH", 8 + len(perf) + len(payload), 2, 0, channel) + perf + payload


def _flow(channel: int) -> bytes:
    perf = b"\x00\x53\x13\xc0\x02\x01\x43"
    return struct.pack(">IBBH", 8 + len(perf), 2, 0, channel) + perf


def _ids_and_payloads(stream: bytes) -> list[tuple[int, int | None, bytes]]:
    out, pos = [], len(HEADER)
    while pos < len(stream):
        size, doff, _, channel = struct.unpack_from(">IBBH", stream, pos)
        body = pos + doff * 4
        if stream[body + 2] == 0x14:
            _, first, _ = compound_items(stream, body + 3)
            did = decode_value(stream, skip_value(stream, first))[0]
            out.append((channel, did, stream[skip_value(stream, body + 3) : pos + size]))
        pos += size
    return out


STREAM = HEADER + b"".join(
    (
        _transfer(0, 0, b"a" * 300),
        _flow(0),
        _transfer(0, 1, b"b"),
        _transfer(0, 1, b"c" * 70000),  # the SDK's race: a repeated id
        _transfer(1, 7, b"d"),  # another session counts on its own
        _transfer(0, 0, b"e", more=True),  # a multi-frame delivery: renumbered once
        _transfer(0, None, b"f"),
        _transfer(0, 255, b"g"),  # any later id out of order is renumbered too
    )
)
EXPECTED = [(0, 0, b"a" * 300), (0, 1, b"b"), (0, 2, b"c" * 70000), (1, 7, b"d"), (0, 3, b"e"), (0, None, b"f")]
EXPECTED.append((0, 4, b"g"))


@pytest.mark.parametrize("chunk", [1, 3, 8, 29, 4096, len(STREAM)])
def test_repeated_delivery_ids_are_renumbered_in_any_read_size(chunk: int):
    seq = DeliveryIdSequencer()
    out = b""
    for i in range(0, len(STREAM), chunk):
        piece = memoryview(STREAM[i : i + chunk])
        fixed = seq.feed(piece)
        out += bytes(piece) if fixed is None else fixed
    assert seq.held == 0
    assert _ids_and_payloads(out) == EXPECTED


def test_frames_in_order_pass_through_untouched():
    stream = HEADER + _transfer(0, 0, b"x") + _transfer(0, 1, b"y")
    assert DeliveryIdSequencer().feed(memoryview(stream)) is None
