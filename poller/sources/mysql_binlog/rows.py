"""Binlog changes as the rows a page carries (the hot path of a catch-up)."""

from __future__ import annotations

from typing import Any

from poller.ports import EventFields, SourceRow
from poller.sources.mysql_binlog.position import BinlogPosition
from shared.errors import SourceError
from shared.models import Position, SnapshotState

__all__ = ["RowMaker", "binary_widths", "pad_binary", "text_values"]

_STRING, _BINARY = 254, "binary"  # BINARY(n): a fixed-length string column of the binary character set


def text_values(image: dict[str, Any] | None) -> dict[str, Any] | None:
    """A signal row's values as text (the binlog may carry a TEXT column as bytes)."""
    if image is None:
        return None
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in image.items()}


class RowMaker:
    """:class:`~poller.sources.mysql_binlog.reader.BinlogChange` → the row a page carries: the hot path of
    a catch-up. What depends only on the transaction (the event cursor's head, the checkpoint's
    cursor and tiebreaker) is worked out once per transaction, not per change (a regex and a dict
    each), and the library's row dicts are passed on, not copied (nobody mutates a row's values)."""

    __slots__ = ("_head", "_key", "_keys", "_number", "_tail", "_txn")

    def __init__(self) -> None:
        self._txn: BinlogPosition | None = None  # the transaction the forms below are of
        self._number, self._head = 0, ()
        self._tail: dict[str, Any] = {}  # the checkpoint's tiebreaker but its seq
        self._keys: tuple[str, ...] = ()
        self._key: str | None = None  # a one-column key's name: read without a loop

    def __call__(self, change: Any, state: SnapshotState | None = None) -> SourceRow:
        txn, seq, kind, table, pk_names, before, after, committed_at = change  # a tuple: unpacked at C speed
        if txn is not self._txn:
            checkpoint = txn.to_position()
            tail = dict(checkpoint.pk)
            del tail["seq"]  # per change, first (the order the checkpoint is written in)
            self._txn, self._number, self._head, self._tail = txn, checkpoint.cursor, txn.event_cursor()[:-1], tail
        if pk_names is not self._keys:  # one tuple per row event
            self._keys, self._key = pk_names, pk_names[0] if len(pk_names) == 1 else None
        deleted = kind == "delete"
        image = before if deleted else after
        key = self._key
        try:
            pk = {key: image[key]} if key is not None else {p: image[p] for p in pk_names}
        except KeyError:
            raise _lacks_key(change, image) from None
        fields = EventFields(pk, (*self._head, seq), kind, before, table, None, committed_at)
        # A snapshot's state rides on every position (into the checkpoint) while one runs.
        return SourceRow(Position(self._number, {"seq": seq, **self._tail}, state), after or {}, deleted, fields)


def _lacks_key(c: Any, image: dict[str, Any]) -> SourceError:
    missing = [p for p in c.pk if p not in image]
    return SourceError(
        f"{c.kind} on {c.table} at {c.position} lacks key column(s) {missing}",
        hint="set pk to columns of the table (or drop pk: each table's primary key is used)",
    )


def binary_widths(event: Any) -> list[tuple[str, int]]:
    """The ``BINARY(n)`` columns of a rows event's table: ``(name, n)``."""
    return [
        (c.name, int(c.max_length))
        for c in event.columns
        if c.type == _STRING and c.character_set_name == _BINARY and getattr(c, "max_length", None)
    ]


def pad_binary(rows: list[dict[str, Any]], widths: list[tuple[str, int]]) -> None:
    """Trailing ``0x00`` bytes back on ``BINARY(n)`` values (the binlog strips them; the row holds them)."""
    for row in rows:
        for key in ("values", "before_values", "after_values"):
            image = row.get(key)
            if image is None:
                continue
            for name, width in widths:
                value = image.get(name)
                if value == "":  # all 0x00: stripped to nothing, which the library hands over as a str
                    image[name] = bytes(width)
                elif isinstance(value, bytes) and len(value) < width:
                    image[name] = value.ljust(width, b"\0")
