"""Binlog events the ``mysql-replication`` library does not decode: MariaDB's compressed events,
decompressed here into the events it does; everything else it does not know, named.

MariaDB with ``log_bin_compress = ON`` writes a query or row event of at least
``log_bin_compress_min_len`` bytes as a *compressed* event type (165-171) the library maps to its
``NotImplementedEvent``. Only the event's last part is compressed (a query event's statement; a
rows event's row images, after the column count and bitmaps), as one header byte (``0x80 |``
the length's size in bytes), the uncompressed length (big-endian), then a zlib stream. This module
rebuilds the plain event (the same header and post-header, the data inflated, the type the plain
one) and has the library decode it with the stream's own table maps, so a compressed change is
read exactly as a plain one.

MySQL 8.0.20+ with ``binlog_transaction_compression = ON`` wraps whole transactions in a
``TRANSACTION_PAYLOAD`` event (zstd): not decoded here; the reader stops with an error naming
the setting (``dbfanout validate`` fails on it too).
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

from shared.errors import SourceError

__all__ = [
    "BENIGN_TYPES",
    "PARTIAL_UPDATE_ROWS",
    "TRANSACTION_PAYLOAD",
    "decompress",
    "event_body",
    "unknown_error",
    "unknown_kind",
]

_QUERY_COMPRESSED = 0xA5
#: MariaDB's compressed rows events → the plain type (V1: 166-168, V2: 169-171).
_ROWS = {0xA6: 0x17, 0xA7: 0x18, 0xA8: 0x19, 0xA9: 0x1E, 0xAA: 0x1F, 0xAB: 0x20}
_UPDATES = (0xA7, 0xAA)  # rows events with a second (after image) column bitmap
_V2 = (0xA9, 0xAA, 0xAB)  # rows events with an extra-data block after the flags
TRANSACTION_PAYLOAD = 0x28
PARTIAL_UPDATE_ROWS = 0x27  # MySQL's binlog_row_value_options = PARTIAL_JSON: JSON diffs, not rows
#: Event types the library does not decode that carry no change: MySQL's anonymous GTID (a
#: transaction's start with gtid_mode = OFF; its BEGIN follows), ignorable events, transaction
#: context and view change (group replication), heartbeat v2.
BENIGN_TYPES = frozenset({0x1C, 0x22, 0x24, 0x25, 0x29})
_IGNORABLE_FLAG = 0x80  # LOG_EVENT_IGNORABLE_F: a server may write any such event; replicas skip it
_STREAM = "_BinLogStreamReader__"  # the library keeps its parser's settings in name-mangled attributes


def unknown_kind(packet: Any, where: str) -> int | None:
    """What to do with an event the library does not decode: None, decompress it; -1, skip it (it
    carries no change); else its type, unknown (an error in a transaction of a listed table).
    MySQL's compressed transaction is an error at once, naming the setting."""
    kind = int(packet.event_type)
    if kind == _QUERY_COMPRESSED or kind in _ROWS:
        return None
    if kind == TRANSACTION_PAYLOAD:
        raise SourceError(
            f"the binlog at {where} holds a compressed transaction (TRANSACTION_PAYLOAD), which this reader "
            "cannot decode",
            hint="set binlog_transaction_compression = OFF on the server (MySQL 8.0.20+); then `dbfanout "
            "checkpoint reset` the poller and reload the tables with `dbfanout snapshot`: transactions "
            "written compressed cannot be read",
        )
    if kind in BENIGN_TYPES or int(packet.flags) & _IGNORABLE_FLAG:
        return -1
    return kind


def unknown_error(transaction: Any, kind: int | None) -> SourceError:
    """The error of a transaction that changes a listed table and holds an event of type ``kind``."""
    if kind == PARTIAL_UPDATE_ROWS:
        return SourceError(
            f"the binlog transaction at {transaction} holds a partial JSON update of a polled table (no whole row)",
            hint="set binlog_row_value_options = '' on the server (MySQL 8.0.3+); the checkpoint stays before it",
        )
    return SourceError(
        f"the binlog transaction at {transaction} changes a polled table and holds an event of type "
        f"{kind or 0:#x} this reader does not know: it cannot be delivered whole",
        hint="the server writes an event dbfanout does not support (see docs/operations.md, the binlog's "
        "settings); the checkpoint stays before the transaction until a dbfanout that reads it runs",
    )


def decompress(stream: Any, packet: Any) -> Any | None:
    """The plain event of a compressed one, decoded by the library (None: a rows event of a table
    the stream filters out, or an event type the stream does not hand over)."""
    event_type = int(packet.event_type)
    use_checksum = bool(getattr(stream, _STREAM + "use_checksum"))
    body = event_body(stream, packet)
    try:
        if event_type == _QUERY_COMPRESSED:
            head, packed, plain_type = _query_parts(stream, body)
        else:
            table_id = int.from_bytes(body[:6], "little")
            if table_id not in stream.table_map:
                return None  # its table map was filtered out: another table's rows
            head, packed, plain_type = _rows_parts(body, event_type)
        data = head + _inflate(packed)
    except (IndexError, ValueError, zlib.error) as exc:
        raise SourceError(
            f"a compressed binlog event (type {event_type:#x}, ending at {packet.log_pos}) cannot be read: {exc}",
            hint="set log_bin_compress = OFF on the server; changes written compressed before that are "
            "read if their events are intact",
        ) from exc
    return _decode(stream, packet, plain_type, data + (b"\0\0\0\0" if use_checksum else b""))


def event_body(stream: Any, packet: Any) -> bytes:
    """An event's bytes after its 19-byte header, without its checksum (as the server sent them)."""
    body: bytes = packet.packet.get_all_data()[20:]  # after the OK byte and the header
    return body[:-4] if getattr(stream, _STREAM + "use_checksum") else body


def _query_parts(stream: Any, body: bytes) -> tuple[bytes, bytes, int]:
    """A query event: post-header (thread id, time, db length, error code, status vars length),
    status vars, the database and its NUL, then the compressed statement."""
    lengths = getattr(stream, _STREAM + "post_header_lengths", None)
    post = 13
    if lengths and len(lengths) > 1:
        post = int(lengths[1])  # the format description's post-header length of QUERY_EVENT (type 2)
    db_len = body[8]
    status_len = struct.unpack_from("<H", body, 11)[0]
    end = post + status_len + db_len + 1
    return body[:end], body[end:], 0x02


def _rows_parts(body: bytes, event_type: int) -> tuple[bytes, bytes, int]:
    """A rows event: table id, flags (V2: extra data), the column count, the bitmaps, then rows."""
    pos = 8
    if event_type in _V2:
        pos += struct.unpack_from("<H", body, pos)[0]  # the extra data's length counts its own 2 bytes
    width, pos = _packed_int(body, pos)
    pos += ((width + 7) // 8) * (2 if event_type in _UPDATES else 1)
    return body[:pos], body[pos:], _ROWS[event_type]


def _packed_int(data: bytes, pos: int) -> tuple[int, int]:
    first = data[pos]
    if first < 251:
        return first, pos + 1
    size = {252: 2, 253: 3, 254: 8}.get(first)
    if size is None:
        raise ValueError(f"bad packed integer {first:#x}")
    return int.from_bytes(data[pos + 1 : pos + 1 + size], "little"), pos + 1 + size


def _inflate(packed: bytes) -> bytes:
    header = packed[0]
    if not header & 0x80:
        raise ValueError(f"bad compressed header byte {header:#x}")
    size_len = header & 0x07
    size = int.from_bytes(packed[1 : 1 + size_len], "big")
    data = zlib.decompress(packed[1 + size_len :])
    if len(data) != size:
        raise ValueError(f"inflated {len(data)} bytes, the header says {size}")
    return data


def _decode(stream: Any, packet: Any, plain_type: int, body: bytes) -> Any | None:
    from pymysql.protocol import MysqlPacket
    from pymysqlreplication.packet import BinLogPacketWrapper

    header = struct.pack(
        "<cIBIIIH", b"\0", packet.timestamp, plain_type, packet.server_id, 19 + len(body), packet.log_pos, packet.flags
    )

    def setting(name: str) -> Any:
        return getattr(stream, _STREAM + name)

    wrapped = BinLogPacketWrapper(
        MysqlPacket(header + body, "utf8"), stream.table_map, stream._ctl_connection, stream.mysql_version,
        setting("use_checksum"), setting("allowed_events_in_packet"), setting("only_tables"),
        setting("ignored_tables"), setting("only_schemas"), setting("ignored_schemas"), setting("freeze_schema"),
        setting("ignore_decode_errors"), False, setting("optional_meta_data"), setting("enable_logging"),
        setting("use_column_name_cache"), setting("post_header_lengths"),
    )  # fmt: skip
    return wrapped.event
