"""Renumber the delivery-ids of incoming transfers into the sequence proton insists on.

The SDK's pure-Python AMQP stack reads and bumps a session's ``next_outgoing_id`` without a lock;
``AutoLockRenewer`` renews locks from several threads on one management link, so the client can
send delivery-ids 1, 2, then 1 again. proton closes the whole connection on that
(``amqp:session:invalid-field "sequencing error"``); the service only counts incoming deliveries.
We do the same by rewriting each transfer's delivery-id, before proton reads it, to the id proton
expects next on that channel. Frames that need no change pass through as they are.
"""

from __future__ import annotations

import struct

from sbemulator.codec import CodecError, compound_items, decode_value, skip_value

_TRANSFER_CODE = 0x14
_BEGIN, _END = 0x11, 0x17
_PROTOCOL_HEADER = b"AMQP"
_U32, _FRAME_HEAD = struct.Struct(">I"), struct.Struct(">IBBH")
MAX_HELD = 64 * 1024  # a performative larger than this is not a transfer we can fix: pass it on


def _enc_uint(value: int) -> bytes:
    if value == 0:
        return b"\x43"
    if value < 256:
        return bytes((0x52, value))
    return b"\x70" + _U32.pack(value)


class DeliveryIdSequencer:
    """Per-connection filter of the bytes a client sends (see the module docstring)."""

    def __init__(self) -> None:
        self._held = b""  # the start of a frame whose performative is not complete yet
        self._skip = 0  # bytes of the current frame's payload still to pass through unchanged
        self._next: dict[int, int] = {}  # channel -> the delivery-id proton expects next
        self._open: dict[int, int] = {}  # channel -> id of a multi-frame delivery in progress
        self.renumbered = 0

    @property
    def held(self) -> int:
        """Bytes kept back until the rest of their frame's performative arrives."""
        return len(self._held)

    def feed(self, data: memoryview) -> bytes | None:
        """The bytes to hand to proton for ``data``; None means "``data`` unchanged"."""
        buf: bytes | memoryview = data
        if self._held:
            buf = self._held + bytes(data)
            self._held = b""
        out: list[bytes | memoryview] = []
        n, pos, last = len(buf), 0, 0
        if self._skip:
            pos = min(self._skip, n)
            self._skip -= pos
        while pos < n:
            step = self._step(buf, pos, n)
            if step is None:
                break  # the frame's head continues in the next read
            next_pos, fixed, fixed_end = step
            if fixed is not None:
                out += (buf[last:pos], fixed)
                last = fixed_end
                self.renumbered += 1
            pos = next_pos
        if pos < n:
            self._held = bytes(buf[pos:])
        if not out and buf is data and not self._held:
            return None
        out.append(buf[last:pos])
        return b"".join(bytes(p) for p in out)

    def _step(self, buf: bytes | memoryview, pos: int, n: int) -> tuple[int, bytes | None, int] | None:
        """Look at the frame starting at ``pos``: (start of the next frame, a rewritten frame head
        or None, where the rewritten head ends); None when its head is not complete yet."""
        if n - pos < 8:
            return None
        if buf[pos : pos + 4] == _PROTOCOL_HEADER:
            return pos + 8, None, 0
        size, doff, ftype, channel = _FRAME_HEAD.unpack_from(buf, pos)
        body, end = pos + doff * 4, pos + size
        if ftype != 0 or end <= body:  # SASL frame, or an empty (keep-alive) frame
            return self._advance(end, n), None, 0
        if body + 3 > n:
            return None
        code = buf[body + 2] if buf[body] == 0 and buf[body + 1] == 0x53 else -1
        if code in (_BEGIN, _END):
            self._next.pop(channel, None)
            self._open.pop(channel, None)
        if code != _TRANSFER_CODE:
            return self._advance(end, n), None, 0
        try:
            perf_end = skip_value(buf, body + 3)
        except CodecError:  # the performative is cut off by the end of this read
            return (self._advance(end, n), None, 0) if n - pos > MAX_HELD else None
        fixed = self._fix(bytes(buf[pos:perf_end]), body - pos, channel)
        return self._advance(end, n), fixed, perf_end

    def _advance(self, end: int, n: int) -> int:
        if end > n:
            self._skip = end - n
            return n
        return end

    def _fix(self, frame: bytes, body: int, channel: int) -> bytes | None:
        """The frame head and transfer performative with the delivery-id we expect, or None if unchanged."""
        count, first, list_end = compound_items(frame, body + 3)
        fields: list[tuple[int, int]] = []
        p = first
        for _ in range(min(count, 6)):
            e = skip_value(frame, p)
            fields.append((p, e))
            p = e
        delivery_id = decode_value(frame, fields[1][0])[0] if len(fields) > 1 else None
        more = len(fields) > 5 and decode_value(frame, fields[5][0])[0] is True
        if channel in self._open:
            expected = self._open[channel]
        elif delivery_id is None:
            return None
        else:
            expected = self._next.get(channel, delivery_id)
            self._next[channel] = expected + 1
        if more:
            self._open[channel] = expected
        else:
            self._open.pop(channel, None)
        if delivery_id is None or delivery_id == expected:
            return None
        id_start, id_end = fields[1]
        items = frame[first:id_start] + _enc_uint(expected) + frame[id_end:list_end]
        if len(items) + 1 <= 255:
            perf = bytes((0xC0, len(items) + 1, count)) + items
        else:
            perf = b"\xd0" + struct.pack(">II", len(items) + 4, count) + items
        head = frame[:body] + frame[body : body + 3]
        old_perf_len = list_end - (body + 3)
        size = _U32.unpack_from(frame, 0)[0] + len(perf) - old_perf_len
        return _U32.pack(size) + head[4:] + perf
