"""The one JSON codec (orjson) for values, cursors, state blobs and batch envelopes.

Values that JSON cannot carry natively travel as strings with a *type tag* next to them, so
they round-trip exactly (a tz-aware datetime to the microsecond and its offset, a 200-digit
integer, a Decimal with its exponent, a UUID, bytes, an address, a range) while staying
readable from other languages. Tags are sparse: a value JSON carries as-is has none. A value
of a type the codec does not know travels as its text and never stops a poller; docs/types.md
maps every database type to its JSON form, its tag and the value a handler gets.

One module per job: ``values`` (one value), ``ranges``, ``columns`` (a page's columns at
once), ``cursors`` (value maps, cursors, generic JSON), ``state`` (the state blob),
``envelope`` (events and batches) and ``batches`` (decoding a message body).
"""

from __future__ import annotations

from shared.codec.batches import decode_batch, decode_events
from shared.codec.columns import ColumnJson, ColumnTags, column_json, encode_column
from shared.codec.cursors import cursor_kind, dumps, loads
from shared.codec.envelope import decode_event, encode_batch, encode_event, envelope_header
from shared.codec.ranges import Range
from shared.codec.state import (
    decode_position,
    decode_snapshot,
    decode_state,
    encode_position,
    encode_snapshot,
    encode_state,
)
from shared.codec.values import TEXT_TAG, decode_value, encode_value, exact_value, tag_of

__all__ = [
    "TEXT_TAG",
    "ColumnJson",
    "ColumnTags",
    "Range",
    "column_json",
    "cursor_kind",
    "decode_batch",
    "decode_event",
    "decode_events",
    "decode_position",
    "decode_snapshot",
    "decode_state",
    "decode_value",
    "dumps",
    "encode_batch",
    "encode_column",
    "encode_event",
    "encode_position",
    "encode_snapshot",
    "encode_state",
    "encode_value",
    "envelope_header",
    "exact_value",
    "loads",
    "tag_of",
]
