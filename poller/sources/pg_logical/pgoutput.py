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

Why it reads bytes by hand: this is the reader's hottest loop (every change of the slot passes
here), so a message is parsed with integer offsets into its bytes and one ``struct`` call per
field group, and each relation gets a plan (its columns, and each column's loader, looked up
once) instead of per-field method calls. Anything it does not know stops it
(:class:`~shared.errors.SourceError`): a message type, a column kind, more columns than the
relation has, a change before its relation; nothing is skipped.
"""

from __future__ import annotations

import datetime as dt
import struct
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from shared.errors import SourceError
from shared.models import Lsn

_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)

__all__ = ["Change", "Decoder", "Loader", "Relation", "TypeLoaders"]

Loader = Callable[[int, bytes], Any]
ChangeKind = Literal["insert", "update", "delete", "truncate"]


class TypeLoaders(Protocol):
    """A :data:`Loader` that also hands out one type's loader, looked up once (the fast path)."""

    def __call__(self, oid: int, data: bytes) -> Any: ...

    def for_type(self, oid: int) -> Callable[[bytes], Any]:
        """The loader of one type OID's text (may raise on a value it cannot load: see :meth:`refused`)."""
        ...

    def refused(self, oid: int, data: bytes, exc: Exception) -> Any:
        """The value of ``data`` that ``for_type(oid)`` raised ``exc`` on (or raise)."""
        ...


_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_U32_AT_1 = struct.Struct(">xI")  # a change or Relation message: its relation OID after the tag
_BEGIN = struct.Struct(">xQqI")  # final (commit) LSN, commit time, xid
_COMMIT = struct.Struct(">xbQQ")  # flags, commit LSN, end LSN
_TRUNCATE = struct.Struct(">xib")  # relations, options
_FLAGS = struct.Struct(">b")  # a column's flags, then its name (a C string)
_TYPE = struct.Struct(">Ii")  # type OID, typmod

# Message and column tags, as the byte values a message's bytes index to.
_B, _C, _R, _I, _U, _D, _T = b"BCRIUDT"
_CHANGES = frozenset(b"IUDT")  # a row's change, or a TRUNCATE: each takes the next seq
_IGNORED = frozenset(b"YOM")  # type, origin, message: nothing a change event needs
_KEY, _OLD, _NEW = b"KON"
_OLD_TUPLE = frozenset(b"KO")
_TEXT, _NULL, _TOAST = b"tnu"

_UNCHANGED: Any = object()  # an unchanged TOASTed value: not sent
_NONE: tuple[Change, ...] = ()


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
    qualified: str = field(init=False, repr=False, compare=False)  # "schema.name", made once

    def __post_init__(self) -> None:
        object.__setattr__(self, "qualified", f"{self.schema}.{self.name}")


@dataclass(slots=True)
class Change:
    """One row change of a committed transaction.

    ``commit_lsn`` is the LSN of the transaction's commit record; ``seq`` numbers the changes of
    the transaction from 0 (relations, begin and commit are not counted), so ``(commit_lsn, seq)``
    is a total order that does not depend on where a peek started. ``end_lsn`` is the LSN just
    past the commit record: advancing the slot there consumes the whole transaction.

    ``new`` and ``old`` are read-only once made: a row built from the change shares them.
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


class _Plan:
    """How one relation's tuples are read: its columns and their loaders (each looked up at its first value)."""

    __slots__ = ("columns", "keys", "loads", "oids", "relation", "width")

    def __init__(self, relation: Relation) -> None:
        self.relation = relation
        self.columns = relation.columns
        self.keys = relation.key_columns
        self.oids = relation.type_oids
        self.width = len(relation.columns)
        self.loads: list[Callable[[bytes], Any] | None] = [None] * self.width


class _Plain:
    """A plain ``load(oid, data)`` as :class:`TypeLoaders` (its errors are raised as they are)."""

    __slots__ = ("_load",)

    def __init__(self, load: Loader) -> None:
        self._load = load

    def __call__(self, oid: int, data: bytes) -> Any:
        return self._load(oid, data)

    def for_type(self, oid: int) -> Callable[[bytes], Any]:
        load = self._load
        return lambda data: load(oid, data)

    def refused(self, oid: int, data: bytes, exc: Exception) -> Any:
        raise exc


class Decoder:
    """Stateful: relations persist across messages of one peek (each peek re-sends the ones it uses)."""

    def __init__(self, load: Loader | TypeLoaders, skip_through: tuple[int, int] | None = None) -> None:
        self._loaders: TypeLoaders = load if hasattr(load, "for_type") else _Plain(load)  # type: ignore[assignment]
        self._by_type: dict[int, Callable[[bytes], Any]] = {}
        # Changes at or before this (commit LSN, seq) are only counted, not parsed: a peek
        # re-reads what the slot still holds, and the checkpoint already covers them.
        self._skip = skip_through
        self.relations: dict[int, Relation] = {}
        self._plans: dict[int, _Plan] = {}
        self._txn: tuple[Lsn, int, int] | None = None  # commit LSN, xid, commit time
        self._skip_seq = -1  # this transaction's changes up to this seq are skipped (see _skip)
        self._seq = 0
        self._pending: list[Change] = []

    def feed(self, data: bytes) -> Sequence[Change]:
        """Decode one message. Changes are returned at the transaction's Commit (with its end LSN)."""
        tag = data[0]
        if tag in _CHANGES:
            txn = self._txn
            if txn is None:
                raise SourceError("pgoutput: a change arrived outside a transaction (Begin missing)")
            if self._seq <= self._skip_seq:
                self._seq += 1
            else:
                self._pending.append(self._truncate(data, txn) if tag == _T else self._row(tag, data, txn))
            return _NONE
        if tag == _B:
            final_lsn, commit_time, xid = _BEGIN.unpack_from(data)
            lsn = Lsn(final_lsn)
            self._txn, self._seq, self._pending = (lsn, xid, commit_time), 0, []
            skip = self._skip
            if skip is None or lsn > skip[0]:
                self._skip_seq = -1
            else:
                self._skip_seq = skip[1] if lsn == skip[0] else sys.maxsize
            return _NONE
        if tag == _C:
            return self._commit(data)
        if tag == _R:
            self._relation(data)
            return _NONE
        if tag in _IGNORED:
            return _NONE
        raise SourceError(f"pgoutput: unknown message type {chr(tag)!r}")

    def _commit(self, data: bytes) -> list[Change]:
        end_lsn = Lsn(_COMMIT.unpack_from(data)[2])
        pending, self._pending, self._txn = self._pending, [], None
        if pending:
            for change in pending:
                change.end_lsn = end_lsn
            pending[-1].last_in_txn = True  # skipped changes are a prefix: this one ends the transaction
        return pending

    def resume(self, begin: bytes, relations: Iterable[bytes], seq: int) -> None:
        """Continue a transaction mid-way (a spool's seek point, :mod:`poller.sources.pg_logical.spool`): its
        Begin message, the Relation messages in effect there, and the ``seq`` of the next change."""
        for data in (begin, *relations):
            self.feed(data)
        self._seq = seq

    @property
    def in_transaction(self) -> bool:
        """Whether a Begin was read and its Commit not yet."""
        return self._txn is not None

    @property
    def pending(self) -> int:
        """Changes of the transaction being read (returned at its Commit)."""
        return len(self._pending)

    def partial(self) -> list[Change]:
        """The changes read so far of a transaction whose Commit was not read (the reader stopped
        early): their ``end_lsn`` is not known, and none is marked the last of its transaction."""
        pending, self._pending = self._pending, []
        return pending

    def _relation(self, data: bytes) -> None:
        (oid,) = _U32_AT_1.unpack_from(data)
        schema, pos = _string(data, 5)
        name, pos = _string(data, pos)
        identity = chr(data[pos])
        (count,) = _I16.unpack_from(data, pos + 1)
        pos += 3
        columns, types, keys = [], [], []
        for _ in range(count):
            (flags,) = _FLAGS.unpack_from(data, pos)
            column, pos = _string(data, pos + 1)
            type_oid, _typmod = _TYPE.unpack_from(data, pos)
            pos += _TYPE.size
            columns.append(column)
            types.append(type_oid)
            if flags & 1:
                keys.append(column)
        relation = Relation(oid, schema or "pg_catalog", name, identity, tuple(columns), tuple(types), tuple(keys))
        self.relations[oid] = relation
        self._plans[oid] = _Plan(relation)

    def _plan(self, oid: int) -> _Plan:
        try:
            return self._plans[oid]
        except KeyError:
            raise SourceError(f"pgoutput: change for relation {oid} before its Relation message") from None

    def _truncate(self, data: bytes, txn: tuple[Lsn, int, int]) -> Change:
        count, _options = _TRUNCATE.unpack_from(data)
        rels = tuple(self._plan(_U32.unpack_from(data, 6 + 4 * i)[0]).relation for i in range(count))
        lsn, xid, at = txn
        change = Change(lsn, lsn, self._seq, xid, at, "truncate", rels[0], truncated=rels)
        self._seq += 1
        return change

    def _row(self, tag: int, data: bytes, txn: tuple[Lsn, int, int]) -> Change:
        """An Insert, Update or Delete message: its tuples, read with the relation's plan."""
        plan = self._plan(_U32_AT_1.unpack_from(data)[0])
        part, pos = data[5], 6
        old: dict[str, Any] | None = None
        old_is_key = old_partial = False
        if part in _OLD_TUPLE:  # Update/Delete: the old key, or the whole old row (REPLICA IDENTITY FULL)
            old_is_key = part == _KEY
            old, pos, old_partial = self._tuple(data, pos, plan)
            if old_is_key:
                old = {c: old[c] for c in plan.keys if c in old}
            if tag == _U:
                part, pos = data[pos], pos + 1
        lsn, xid, at = txn
        seq = self._seq
        self._seq = seq + 1
        if tag == _D:
            if old_partial:
                old = _known(old)
            return Change(lsn, lsn, seq, xid, at, "delete", plan.relation, None, old, old_is_key)
        if part != _NEW:
            raise SourceError(f"pgoutput: expected a new tuple ('N') in {chr(tag)!r}, got {chr(part)!r}")
        new: dict[str, Any] | None
        new, pos, new_partial = self._tuple(data, pos, plan)
        unchanged: tuple[str, ...] = ()
        if new_partial:
            unchanged = tuple(c for c, v in new.items() if v is _UNCHANGED)
            if old is not None and not old_is_key:
                new.update({c: old[c] for c in unchanged})  # FULL identity: the old row has the value
                unchanged = ()
            new = _known(new)
        if old_partial:
            old = _known(old)
        kind: ChangeKind = "insert" if tag == _I else "update"
        return Change(lsn, lsn, seq, xid, at, kind, plan.relation, new, old, old_is_key, unchanged)

    def _tuple(self, data: bytes, pos: int, plan: _Plan) -> tuple[dict[str, Any], int, bool]:
        """The tuple at ``pos``: its values by column, where the message goes on, and whether an
        unchanged TOASTed value (not sent) is among them."""
        (count,) = _I16.unpack_from(data, pos)
        if count > plan.width:
            raise SourceError(f"pgoutput: {count} columns for {plan.relation.qualified}, which has {plan.width}")
        pos += 2
        columns, loads = plan.columns, plan.loads
        unpack = _I32.unpack_from
        values: dict[str, Any] = {}
        partial = False
        for i in range(count):
            kind = data[pos]
            if kind == _TEXT:
                end = pos + 5 + unpack(data, pos + 1)[0]
                text = data[pos + 5 : end]
                pos = end
                load = loads[i]
                if load is None:
                    load = loads[i] = self._type_loader(plan.oids[i])
                try:
                    values[columns[i]] = load(text)
                except Exception as exc:
                    values[columns[i]] = self._loaders.refused(plan.oids[i], text, exc)
            elif kind == _NULL:
                values[columns[i]] = None
                pos += 1
            elif kind == _TOAST:
                values[columns[i]] = _UNCHANGED
                partial = True
                pos += 1
            else:
                raise SourceError(f"pgoutput: unknown column kind {chr(kind)!r} in {plan.relation.qualified}")
        return values, pos, partial

    def _type_loader(self, oid: int) -> Callable[[bytes], Any]:
        load = self._by_type.get(oid)
        if load is None:
            load = self._by_type[oid] = self._loaders.for_type(oid)
        return load


def _string(data: bytes, pos: int) -> tuple[str, int]:
    end = data.index(b"\0", pos)
    return data[pos:end].decode("utf-8"), end + 1


def _known(values: dict[str, Any] | None) -> dict[str, Any] | None:
    """Drop unchanged TOASTed columns (their value was not sent)."""
    if values is None:
        return None
    return {c: v for c, v in values.items() if v is not _UNCHANGED}
