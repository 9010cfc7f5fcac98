"""The pgoutput decoder as it was before issue 41's rewrite: one method call per field.

Kept only as the reference the property tests (test_pgoutput_decode.py) compare the fast decoder
with: the same messages must give the same changes (values, types, order), the same errors. It
builds the real :class:`Change` and :class:`Relation`, so the two outputs compare directly.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from typing import Any

from poller.sources.pg_logical.pgoutput import Change, ChangeKind, Loader, Relation
from shared.errors import SourceError
from shared.models import Lsn

_I8 = struct.Struct(">b")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_U64 = struct.Struct(">Q")

_UNCHANGED = object()  # an unchanged TOASTed value: not sent


class _Reader:
    __slots__ = ("_buf", "_pos")

    def __init__(self, buf: bytes) -> None:
        self._buf = buf
        self._pos = 0

    def take(self, fmt: struct.Struct) -> Any:
        (value,) = fmt.unpack_from(self._buf, self._pos)
        self._pos += fmt.size
        return value

    def byte(self) -> str:
        value = chr(self._buf[self._pos])
        self._pos += 1
        return value

    def string(self) -> str:
        end = self._buf.index(b"\0", self._pos)
        value = self._buf[self._pos : end].decode("utf-8")
        self._pos = end + 1
        return value

    def raw(self, n: int) -> bytes:
        value = self._buf[self._pos : self._pos + n]
        self._pos += n
        return bytes(value)


class Decoder:
    """The reference decoder (the old one)."""

    def __init__(self, load: Loader, skip_through: tuple[int, int] | None = None) -> None:
        self._load = load
        # Changes at or before this (commit LSN, seq) are only counted, not parsed: a peek
        # re-reads what the slot still holds, and the checkpoint already covers them.
        self._skip = skip_through
        self.relations: dict[int, Relation] = {}
        self._txn: tuple[Lsn, int, int] | None = None  # commit LSN, xid, commit time
        self._seq = 0
        self._pending: list[Change] = []

    def feed(self, data: bytes) -> Iterator[Change]:
        """Decode one message. Changes are yielded at the transaction's Commit (with its end LSN)."""
        r = _Reader(data)
        tag = r.byte()
        if tag == "B":
            final_lsn, commit_time, xid = r.take(_U64), r.take(_I64), r.take(_U32)
            self._txn, self._seq, self._pending = (Lsn(final_lsn), xid, commit_time), 0, []
        elif tag == "C":
            yield from self._commit(r)
        elif tag == "R":
            self._relation(r)
        elif tag in "IUDT":
            if self._txn is None:
                raise SourceError("pgoutput: a change arrived outside a transaction (Begin missing)")
            if self._skip is not None and (self._txn[0], self._seq) <= self._skip:
                self._seq += 1
            else:
                self._pending.extend(self._change(tag, r))
        # 'Y' (type), 'O' (origin), 'M' (message): nothing a change event needs.

    def _commit(self, r: _Reader) -> Iterator[Change]:
        r.take(_I8)  # flags (unused)
        r.take(_U64)  # the commit LSN, known since Begin
        end_lsn = Lsn(r.take(_U64))
        pending, self._pending, self._txn = self._pending, [], None
        for change in pending:
            change.end_lsn = end_lsn
        if pending:
            pending[-1].last_in_txn = True  # skipped changes are a prefix: this one ends the transaction
        yield from pending

    def resume(self, begin: bytes, relations: Iterable[bytes], seq: int) -> None:
        """Continue a transaction mid-way (a spool's seek point, :mod:`poller.sources.pg_logical.spool`): its
        Begin message, the Relation messages in effect there, and the ``seq`` of the next change."""
        for data in (begin, *relations):
            for _ in self.feed(data):
                pass
        self._seq = seq

    @property
    def in_transaction(self) -> bool:
        """Whether a Begin was read and its Commit not yet."""
        return self._txn is not None

    @property
    def pending(self) -> int:
        """Changes of the transaction being read (yielded at its Commit)."""
        return len(self._pending)

    def partial(self) -> list[Change]:
        """The changes read so far of a transaction whose Commit was not read (the reader stopped
        early): their ``end_lsn`` is not known, and none is marked the last of its transaction."""
        pending, self._pending = self._pending, []
        return pending

    def _relation(self, r: _Reader) -> None:
        oid, schema, name, identity = r.take(_U32), r.string(), r.string(), r.byte()
        columns, types, keys = [], [], []
        for _ in range(r.take(_I16)):
            flags, column, type_oid = r.take(_I8), r.string(), r.take(_U32)
            r.take(_I32)  # typmod
            columns.append(column)
            types.append(type_oid)
            if flags & 1:
                keys.append(column)
        self.relations[oid] = Relation(oid, schema or "pg_catalog", name, identity, tuple(columns),
                                       tuple(types), tuple(keys))  # fmt: skip

    def _rel(self, oid: int) -> Relation:
        try:
            return self.relations[oid]
        except KeyError:
            raise SourceError(f"pgoutput: change for relation {oid} before its Relation message") from None

    def _change(self, tag: str, r: _Reader) -> Iterator[Change]:
        assert self._txn is not None
        lsn, xid, at = self._txn
        if tag == "T":
            count, _options = r.take(_I32), r.take(_I8)
            rels = tuple(self._rel(r.take(_U32)) for _ in range(count))
            yield self._make(lsn, xid, at, "truncate", rels[0], truncated=rels)
            return
        rel = self._rel(r.take(_U32))
        old: dict[str, Any] | None = None
        old_is_key = False
        part = r.byte()
        if part in "KO":  # Update/Delete: the old key, or the whole old row (REPLICA IDENTITY FULL)
            old_is_key = part == "K"
            old = self._tuple(r, rel)
            if old_is_key:
                old = {c: old[c] for c in rel.key_columns if c in old}
            if tag == "U":
                part = r.byte()
        if tag == "D":
            yield self._make(lsn, xid, at, "delete", rel, old=_known(old), old_is_key=old_is_key)
            return
        if part != "N":
            raise SourceError(f"pgoutput: expected a new tuple ('N') in {tag!r}, got {part!r}")
        new = self._tuple(r, rel)
        unchanged = tuple(c for c, v in new.items() if v is _UNCHANGED)
        if unchanged and old is not None and not old_is_key:
            new.update({c: old[c] for c in unchanged})  # FULL identity: the old row has the value
            unchanged = ()
        kind: ChangeKind = "insert" if tag == "I" else "update"
        yield self._make(lsn, xid, at, kind, rel, new=_known(new), old=_known(old), old_is_key=old_is_key,
                         unchanged=unchanged)  # fmt: skip

    def _make(self, lsn: Lsn, xid: int, at: int, kind: ChangeKind, rel: Relation, **kw: Any) -> Change:
        change = Change(commit_lsn=lsn, end_lsn=lsn, seq=self._seq, xid=xid, commit_time_us=at, kind=kind,
                        relation=rel, **kw)  # fmt: skip
        self._seq += 1
        return change

    def _tuple(self, r: _Reader, rel: Relation) -> dict[str, Any]:
        count = r.take(_I16)
        if count > len(rel.columns):
            raise SourceError(f"pgoutput: {count} columns for {rel.qualified}, which has {len(rel.columns)}")
        values: dict[str, Any] = {}
        for i in range(count):
            kind = r.byte()
            column = rel.columns[i]
            if kind == "n":
                values[column] = None
            elif kind == "u":
                values[column] = _UNCHANGED
            elif kind == "t":
                values[column] = self._load(rel.type_oids[i], r.raw(r.take(_I32)))
            else:
                raise SourceError(f"pgoutput: unknown column kind {kind!r} in {rel.qualified}")
        return values


def _known(values: dict[str, Any] | None) -> dict[str, Any] | None:
    """Drop unchanged TOASTed columns (their value was not sent)."""
    if values is None:
        return None
    return {c: v for c, v in values.items() if v is not _UNCHANGED}
