"""A reader of PostgreSQL's built-in ``pgoutput`` logical decoding messages (protocol version 1).

Pure parsing, no I/O: :class:`Decoder` turns the ``data`` column of
``pg_logical_slot_peek_binary_changes(slot, NULL, n, 'proto_version', '1', 'publication_names', pub)``
into :class:`Change` values, in commit order. The message layouts are those of the PostgreSQL
documentation, "Logical Replication Message Formats": Begin, Commit, Origin, Relation, Type,
Insert, Update, Delete, Truncate (and Message, ignored).

Column values arrive as text (``'t'``), NULL (``'n'``) or *unchanged TOASTed value* (``'u'``: an
update that did not touch a large out-of-line value does not repeat it). Text is converted to
Python values by a ``load(type_oid, text)`` callable (the source uses psycopg's own loaders, so
values have exactly the types the keyset source gives). An unchanged TOASTed column is taken from
the old row when the table has ``REPLICA IDENTITY FULL``; otherwise it is left out of the new row
and named in :attr:`Change.unchanged`.
"""

from __future__ import annotations

import datetime as dt
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from shared.errors import SourceError
from shared.models import Lsn

_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)

__all__ = ["Change", "Decoder", "Loader", "Relation"]

Loader = Callable[[int, bytes], Any]
ChangeKind = Literal["insert", "update", "delete", "truncate"]

_I8 = struct.Struct(">b")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_U64 = struct.Struct(">Q")

_UNCHANGED = object()  # an unchanged TOASTed value: not sent


@dataclass(frozen=True, slots=True)
class Relation:
    """A table as the Relation message describes it (sent again after any schema change)."""

    oid: int
    schema: str
    name: str
    replica_identity: str  # d(efault), n(othing), f(ull), i(ndex)
    columns: tuple[str, ...]
    type_oids: tuple[int, ...]
    key_columns: tuple[str, ...]  # flagged as part of the replica identity

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"


@dataclass(slots=True)
class Change:
    """One row change of a committed transaction.

    ``commit_lsn`` is the LSN of the transaction's commit record; ``seq`` numbers the changes of
    the transaction from 0 (relations, begin and commit are not counted), so ``(commit_lsn, seq)``
    is a total order that does not depend on where a peek started. ``end_lsn`` is the LSN just
    past the commit record: advancing the slot there consumes the whole transaction.
    """

    commit_lsn: Lsn
    end_lsn: Lsn
    seq: int
    xid: int
    commit_time_us: int  # microseconds since 2000-01-01 (PostgreSQL epoch)
    kind: ChangeKind
    relation: Relation
    new: dict[str, Any] | None = None
    old: dict[str, Any] | None = None  # the old key ('K') or the whole old row ('O')
    old_is_key: bool = False
    unchanged: tuple[str, ...] = ()
    last_in_txn: bool = field(default=False, compare=False)
    truncated: tuple[Relation, ...] = ()

    @property
    def key(self) -> tuple[int, int]:
        return (self.commit_lsn, self.seq)

    @property
    def table(self) -> str:
        """The schema-qualified table it changed."""
        return self.relation.qualified

    @property
    def commit_time(self) -> dt.datetime:
        """The transaction's commit time (UTC), as the primary recorded it."""
        return _PG_EPOCH + dt.timedelta(microseconds=self.commit_time_us)


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
    """Stateful: relations persist across messages of one peek (each peek re-sends the ones it uses)."""

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
