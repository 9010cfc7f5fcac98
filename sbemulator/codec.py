"""Just enough AMQP 1.0 message encoding, in pure Python, for the hot path.

A message is a run of described sections (header, annotations, properties, application
properties, body, footer). The broker keeps the bytes the client sent; on delivery we splice in
a fresh header (delivery count) and message annotations (sequence number, lock) and copy the
other sections untouched, which is much cheaper than a full decode/encode per message.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

HEADER, DELIVERY_ANN, MESSAGE_ANN, PROPERTIES, APP_PROPS, DATA, SEQUENCE, VALUE, FOOTER = range(0x70, 0x79)
_SECTION_NAMES = {
    b"amqp:header:list": HEADER,
    b"amqp:delivery-annotations:map": DELIVERY_ANN,
    b"amqp:message-annotations:map": MESSAGE_ANN,
    b"amqp:properties:list": PROPERTIES,
    b"amqp:application-properties:map": APP_PROPS,
    b"amqp:data:binary": DATA,
    b"amqp:amqp-sequence:list": SEQUENCE,
    b"amqp:value:*": VALUE,
    b"amqp:footer:map": FOOTER,
}
_FIXED = {0x40: 0, 0x50: 1, 0x60: 2, 0x70: 4, 0x80: 8, 0x90: 16}
_I64, _I32, _U32 = struct.Struct(">q"), struct.Struct(">i"), struct.Struct(">I")


class CodecError(ValueError):
    """The bytes are not a well-formed AMQP message."""


@dataclass(frozen=True, slots=True)
class Section:
    """One section: its code and where its value starts and ends in the buffer."""

    code: int
    start: int
    value_start: int
    end: int


def skip_value(buf: bytes | memoryview, pos: int) -> int:
    """Position just after the encoded value starting at ``pos``."""
    try:
        c = buf[pos]
        pos += 1
        if c == 0x00:
            return skip_value(buf, skip_value(buf, pos))
        hi = c & 0xF0
        if hi in _FIXED:
            end = pos + _FIXED[hi]
        elif hi in (0xA0, 0xC0, 0xE0):
            end = pos + 1 + buf[pos]
        elif hi in (0xB0, 0xD0, 0xF0):
            end = pos + 4 + _U32.unpack_from(buf, pos)[0]
        else:
            raise CodecError(f"unknown AMQP constructor 0x{c:02x}")
    except (IndexError, struct.error) as exc:
        raise CodecError("truncated AMQP value") from exc
    if end > len(buf):
        raise CodecError("truncated AMQP value")
    return end


def split_sections(buf: bytes) -> list[Section]:
    """The sections of an encoded message; CodecError when it is not one."""
    out, pos, n = [], 0, len(buf)
    while pos < n:
        if buf[pos] != 0x00:
            raise CodecError("message section is not a described type")
        desc_end = skip_value(buf, pos + 1)
        code = _descriptor_code(buf, pos + 1)
        end = skip_value(buf, desc_end)
        out.append(Section(code, pos, desc_end, end))
        pos = end
    return out


def _descriptor_code(buf: bytes, pos: int) -> int:
    c = buf[pos]
    if c == 0x53:
        return buf[pos + 1]
    if c == 0x80:
        return int.from_bytes(buf[pos + 1 : pos + 9], "big")
    if c in (0xA3, 0xB3):
        name = decode_value(buf, pos)[0]
        return _SECTION_NAMES.get(name.encode(), -1)
    return -1


def compound_items(buf: bytes, pos: int) -> tuple[int, int, int]:
    """(element count, first element position, end) of a list or map at ``pos``."""
    c = buf[pos]
    if c == 0x45 or c == 0x40:
        return 0, pos + 1, pos + 1
    if c in (0xC0, 0xC1):
        return buf[pos + 2], pos + 3, pos + 2 + buf[pos + 1]
    if c in (0xD0, 0xD1):
        size, count = struct.unpack_from(">II", buf, pos + 1)
        return count, pos + 9, pos + 5 + size
    raise CodecError(f"expected a list or map, found constructor 0x{c:02x}")


def iter_values(buf: bytes, pos: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each element of the list or map at ``pos``."""
    count, p, _ = compound_items(buf, pos)
    for _ in range(count):
        end = skip_value(buf, p)
        yield p, end
        p = end


def decode_value(buf: bytes, pos: int) -> tuple[Any, int]:  # noqa: C901 - one branch per type
    """Decode a scalar (and skip compounds as None); returns (value, end)."""
    c = buf[pos]
    end = skip_value(buf, pos)
    p = pos + 1
    if c in (0x40, 0x45):
        return None, end
    if c in (0x41, 0x42):
        return c == 0x41, end
    if c == 0x56:
        return buf[p] == 1, end
    if c in (0x43, 0x44):
        return 0, end
    if c in (0x50, 0x52, 0x53):
        return buf[p], end
    if c == 0x51:
        return struct.unpack_from(">b", buf, p)[0], end
    if c in (0x54, 0x55):
        return struct.unpack_from(">b", buf, p)[0], end
    if c == 0x60:
        return struct.unpack_from(">H", buf, p)[0], end
    if c == 0x61:
        return struct.unpack_from(">h", buf, p)[0], end
    if c == 0x70:
        return _U32.unpack_from(buf, p)[0], end
    if c == 0x71:
        return _I32.unpack_from(buf, p)[0], end
    if c == 0x80:
        return struct.unpack_from(">Q", buf, p)[0], end
    if c in (0x81, 0x83):
        return _I64.unpack_from(buf, p)[0], end
    if c == 0x98:
        return uuid.UUID(bytes=bytes(buf[p : p + 16])), end
    if c in (0xA0, 0xB0):
        return bytes(buf[p + (1 if c == 0xA0 else 4) : end]), end
    if c in (0xA1, 0xA3, 0xB1, 0xB3):
        return bytes(buf[p + (1 if c < 0xB0 else 4) : end]).decode("utf-8"), end
    return None, end


def map_get(buf: bytes, pos: int, key: str) -> Any:
    """The value of a string/symbol key in the map at ``pos`` (None if absent)."""
    it = iter_values(buf, pos)
    for k_start, _ in it:
        v_start, _ = next(it)
        if buf[k_start] in (0xA1, 0xA3, 0xB1, 0xB3) and decode_value(buf, k_start)[0] == key:
            return decode_value(buf, v_start)[0]
    return None


# ---- encoders ------------------------------------------------------------------------------
def enc_str(s: str, code: int = 0xA1) -> bytes:
    """A string (0xA1) or symbol (0xA3)."""
    b = s.encode("utf-8")
    if len(b) < 256:
        return bytes((code, len(b))) + b
    return bytes((code + 0x10,)) + _U32.pack(len(b)) + b


def enc_symbol(s: str) -> bytes:
    """An AMQP symbol."""
    return enc_str(s, 0xA3)


def enc_long(v: int) -> bytes:
    """An AMQP long."""
    return b"\x81" + _I64.pack(v)


def enc_timestamp(unix_seconds: float) -> bytes:
    """An AMQP timestamp (ms since the epoch)."""
    return b"\x83" + _I64.pack(round(unix_seconds * 1000))


def enc_int(v: int) -> bytes:
    """An AMQP int."""
    return b"\x71" + _I32.pack(v)


def enc_uint(v: int) -> bytes:
    """An AMQP uint."""
    return b"\x70" + _U32.pack(v)


def enc_compound(code: int, items: bytes, count: int) -> bytes:
    """A list32 (0xD0) or map32 (0xD1) from already encoded elements."""
    return bytes((code,)) + _U32.pack(len(items) + 4) + _U32.pack(count) + items


def enc_section(code: int, value: bytes) -> bytes:
    """A described section."""
    return bytes((0x00, 0x53, code)) + value
