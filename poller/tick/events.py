"""Turning fetched rows into events and batches (pure; no I/O)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any, overload

from poller.ports import EventFields, KeysetColumns, Page, SourceRow
from shared.codec import ColumnJson, column_json, dumps, encode_column
from shared.codec.columns import ColumnPieces, column_pieces
from shared.codec.values import _iso
from shared.config import PollerConfig
from shared.ids import EventIds, batch_id_for_range, event_id_for
from shared.messages import EncodedEvents
from shared.models import Batch, RowChange

__all__ = ["LazyEvents", "encode_page", "encode_rows", "page_batch", "to_batch", "to_event"]


def to_event(poller: PollerConfig, fingerprint: str, row: SourceRow, ids: EventIds | None = None) -> RowChange:
    """One row → one event. The id is a pure function of (poller, fingerprint, pk, cursor)."""
    fields = row.event
    if fields is None:  # keyset polling: the pk columns and the cursor column's typed value
        cursor = row.values.get(poller.cursor, row.position.cursor)
        pk = row.position.pk
        version = cursor
        table = keyset_table(poller)
    else:
        cursor, pk, table = fields.cursor, fields.pk, fields.table
        version = cursor if fields.version is None else fields.version
    event_id = ids(pk, version) if ids is not None else event_id_for(poller.name, fingerprint, pk, version)
    return RowChange(
        event_id=event_id,
        op="delete" if row.deleted else "upsert",
        pk=pk,
        cursor=cursor,
        # The source builds a fresh dict per row; nobody mutates it. A change-log delete brings
        # no values (its old key or row is ``before``): its ``after`` is null.
        after=row.values if row.values or not row.deleted else None,
        poller=poller.name,
        before=fields.before if fields is not None else None,
        change=fields.change if fields is not None else None,
        table=table,
        committed_at=fields.committed_at if fields is not None else None,
    )


def keyset_table(poller: PollerConfig) -> str | None:
    """The table a keyset poller's events name: its ``table`` as configured; None for a ``query``."""
    return poller.table if poller.query is None else None


class LazyEvents(Sequence[RowChange]):
    """A batch's events, built on first access (all at once) and then kept.

    The tick needs only the count; a sink that forwards or encodes the events builds them once.
    Compares equal to any sequence of the same events (a decoded batch holds a tuple).
    """

    __slots__ = ("_build", "_count", "_encode", "_events", "tables")

    def __init__(
        self,
        count: int,
        build: Callable[[], tuple[RowChange, ...]],
        encode: Callable[[], EncodedEvents | None] | None = None,
        tables: tuple[str, ...] | None = None,
    ) -> None:
        # The tables the events come from when known without building them (a keyset page's one
        # table, or none for a query); None: read them from the events.
        self.tables = tables
        self._count = count
        self._build: Callable[[], tuple[RowChange, ...]] | None = build
        self._encode = encode
        self._events: tuple[RowChange, ...] | None = None

    def encoded(self) -> EncodedEvents | None:
        """Each event's id and its ``encode_event`` form or JSON bytes, made without building the
        events; None when this batch has no such shortcut (then encode the events)."""
        return self._encode() if self._encode is not None else None

    def _all(self) -> tuple[RowChange, ...]:
        if self._events is None:
            assert self._build is not None
            self._events, self._build = self._build(), None
        return self._events

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> RowChange: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[RowChange]: ...
    def __getitem__(self, index: int | slice) -> RowChange | Sequence[RowChange]:
        return self._all()[index]

    def __iter__(self) -> Iterator[RowChange]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        built = "built" if self._events is not None else "not built yet"
        return f"LazyEvents({self._count} events, {built})"


def _range_id(poller: PollerConfig, fingerprint: str, page: Page) -> str:
    first, last = page.first_row, page.last_row
    assert first is not None and last is not None
    return batch_id_for_range(poller.name, fingerprint, first.position, last.position, len(page))


def to_batch(poller: PollerConfig, fingerprint: str, rows: Sequence[SourceRow]) -> Batch:
    """Built rows → a batch with its events built now (validation, tests)."""
    ids = EventIds(poller.name, fingerprint)
    return Batch(
        poller=poller.name,
        batch_id=_range_id(poller, fingerprint, Page(rows)),
        source_fingerprint=fingerprint,
        events=tuple(to_event(poller, fingerprint, row, ids) for row in rows),
    )


def page_batch(poller: PollerConfig, fingerprint: str, page: Page) -> Batch:
    """A fetched page → its batch; events are built when the sink first reads them.

    Re-fetching the same page (after a failed commit, a crash or a lost lease) yields the same
    batch id and the same event ids.
    """

    def build() -> tuple[RowChange, ...]:
        ids = EventIds(poller.name, fingerprint)
        return tuple(to_event(poller, fingerprint, row, ids) for row in page.rows)

    columns, tuples = page.columns, page.tuples

    table = keyset_table(poller)

    def encode() -> EncodedEvents | None:
        assert columns is not None and tuples is not None
        return encode_page(EventIds(poller.name, fingerprint), columns, tuples, table)

    def encode_log() -> EncodedEvents | None:
        return encode_rows(EventIds(poller.name, fingerprint), page.rows)

    if columns is not None:
        events = LazyEvents(len(page), build, encode, () if table is None else (table,))
    elif tuples is None:  # built rows (a change-log page): encoded row by row, grouped by shape
        events = LazyEvents(len(page), build, encode_log, _row_tables(page.rows, table))
    else:
        events = LazyEvents(len(page), build)
    return Batch(
        poller=poller.name,
        batch_id=_range_id(poller, fingerprint, page),
        source_fingerprint=fingerprint,
        events=events,
    )


def _row_tables(rows: Sequence[SourceRow], keyset: str | None) -> tuple[str, ...]:
    """The tables a page's events name (each event's ``table``), without building the events."""
    tables = {keyset if r.event is None else r.event.table for r in rows}
    tables.discard(None)
    return tuple(tables)  # type: ignore[arg-type]


def encode_rows(ids: EventIds, rows: Sequence[SourceRow]) -> EncodedEvents | None:
    """A change-log page's events (every row with its :class:`EventFields`: pg_logical, binlog,
    outbox, snapshot reads) as JSON bytes, without building a ``RowChange``.

    Exactly ``dumps(encode_event(to_event(...)))`` for each row, and the same ids
    (``tests/poller/tick/test_encode_golden.py`` holds it to main's bytes). The rows are grouped
    by their shape (the pk's, after's and before's keys, the cursor's arity); each group's values
    are encoded column by column (:func:`~shared.codec.columns.column_pieces`) into one bytes
    %-template, and its ids come from the same columns (:meth:`~shared.ids.EventIds.of_columns`).
    Per row there remain a few slots: the id, the op, the ``"types"`` object when tags differ row
    to row (one per distinct combination), the change (one per kind) and the table and commit
    time (one per transaction). None when a row has no event fields (keyset rows: ``to_event``'s
    path)."""
    if not rows:
        return [], []
    fields: list[EventFields] = list(map(_EVENT, rows))
    if type(None) in set(map(type, fields)):  # a keyset row: to_event's path
        return None
    values: list[dict[str, Any]] = list(map(_VALUES, rows))
    deleted: list[bool] = list(map(bool, map(_DELETED, rows)))
    befores = list(map(_BEFORE, fields))
    cursors = list(map(_CURSOR, fields))
    keys = list(
        zip(
            map(tuple, map(_PK, fields)),
            [tuple(v) if v or not d else None for v, d in zip(values, deleted, strict=True)],  # after: to_event's
            [None if b is None else tuple(b) for b in befores],
            [len(c) if type(c) is tuple else -1 for c in cursors],
            strict=True,
        )
    )
    if keys.count(keys[0]) == len(keys):  # one shape (the usual page): no regrouping
        return _encode_group(ids, fields, values, deleted, cursors, befores, *keys[0])
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, key in enumerate(keys):
        if (members := groups.get(key)) is None:
            groups[key] = [index]
        else:
            members.append(index)
    event_ids: list[str] = [""] * len(rows)
    encoded: list[bytes] = [b""] * len(rows)
    for key, members in groups.items():
        pick = itemgetter(*members)  # a tuple of them (one member: the item alone)
        f, v, d, c, b = (
            list(pick(column)) if len(members) > 1 else [pick(column)]
            for column in (fields, values, deleted, cursors, befores)
        )
        found = _encode_group(ids, f, v, d, c, b, *key)
        if found is None:
            return None
        for index, event_id, raw in zip(members, *found, strict=True):
            event_ids[index], encoded[index] = event_id, raw
    return event_ids, encoded


_EVENT, _VALUES, _DELETED = attrgetter("event"), attrgetter("values"), attrgetter("deleted")
_PK, _CURSOR, _BEFORE, _VERSION = attrgetter("pk"), attrgetter("cursor"), attrgetter("before"), attrgetter("version")
_OPS = (b"upsert", b"delete")


def _encode_group(
    ids: EventIds,
    fields: list[EventFields],
    values: list[dict[str, Any]],
    deleted: list[bool],
    cursors: list[Any],
    befores: list[Any],
    pk_names: tuple[str, ...],
    after_names: tuple[str, ...] | None,
    before_names: tuple[str, ...] | None,
    arity: int,
) -> tuple[list[str], list[bytes]] | None:
    """:func:`encode_rows` for rows of one shape (their pk, after and before keys, cursor arity);
    None when a key is not a string (the template writes each key as a JSON string)."""
    if not all(type(n) is str for names in (pk_names, after_names or (), before_names or ()) for n in names):
        return None
    pks = list(map(_PK, fields))
    pk_values = {name: list(map(itemgetter(name), pks)) for name in pk_names}
    versions = list(map(_VERSION, fields))
    if versions.count(None) == len(versions):  # the cursor identifies the change (all but snapshot reads)
        versions = cursors
    else:
        versions = [c if v is None else v for v, c in zip(versions, cursors, strict=True)]
    event_ids = ids.of_columns(pk_values, versions)
    if event_ids is None:
        event_ids = ids.many(pks, versions)
    # Each column: its JSON pieces, spec and tag(s); the cursor's parts one column each.
    columns: list[ColumnPieces] = []

    def add(column: Sequence[Any]) -> ColumnPieces | None:
        found = column_pieces(column)
        if found is not None:
            columns.append(found)
        return found

    cursor_parts = list(zip(*cursors, strict=True)) if arity > 0 else [cursors] if arity < 0 else []
    for part in cursor_parts:
        if add(part) is None:
            return None
    cursor_specs = [c[1] for c in columns]
    sections: list[tuple[str, tuple[str, ...], list[ColumnPieces]]] = []
    for section, section_names, maps in (
        ("pk", pk_names, pks),
        ("after", after_names, values),
        ("before", before_names, befores),
    ):
        if section_names is None:
            continue
        start = len(columns)
        for name in section_names:
            if add(list(map(itemgetter(name), maps))) is None:
                return None
        sections.append((section, section_names, columns[start:]))
    cursor_columns = columns[: len(cursor_specs)]
    template = _group_template(arity, cursor_specs, sections, after_names is not None, before_names is not None)
    ops = list(map(_OPS.__getitem__, deleted))
    types = _types_pieces(arity, cursor_columns, sections, len(fields))
    changes, tails = _tails(fields)
    ids_bytes = "\x1f".join(event_ids).encode().split(b"\x1f")  # ids are ASCII: three C calls
    in_order = [*sections[0][2], *cursor_columns, *(c for _, _, cols in sections[1:] for c in cols)]  # as written
    slots = zip(ids_bytes, ops, *(c[0] for c in in_order), types, changes, tails, strict=True)
    return event_ids, list(map(template.__mod__, slots))


def _group_template(
    arity: int,
    cursor_specs: list[bytes],
    sections: list[tuple[str, tuple[str, ...], list[ColumnPieces]]],
    has_after: bool,
    has_before: bool,
) -> bytes:
    """One shape's event as a bytes %-template: slots for the id, the op, every column's value,
    the ``"types"`` piece, the ``change`` piece and the table and commit time piece, in
    :func:`~shared.codec.encode_event`'s key order."""
    cursor = b"[" + b",".join(cursor_specs) + b"]" if arity >= 0 else cursor_specs[0]
    objects = {
        section: b"{" + b",".join(_literal(n) + b":" + c[1] for n, c in zip(names, cols, strict=True)) + b"}"
        for section, names, cols in sections
    }
    return (
        b'{"event_id":"%b","op":"%b","pk":'
        + objects["pk"]
        + b',"cursor":'
        + cursor
        + b',"after":'
        + (objects["after"] if has_after else b"null")
        + b',"before":'
        + (objects["before"] if has_before else b"null")
        + b"%b%b%b}"
    )


def _types_pieces(
    arity: int,
    cursor_columns: list[ColumnPieces],
    sections: list[tuple[str, tuple[str, ...], list[ColumnPieces]]],
    count: int,
) -> Sequence[bytes]:
    """Each row's ``,"types":{...}`` piece (empty without tags): one per distinct combination of
    the tags that differ row to row (none differ: one piece for every row)."""
    cursor_tags = [c[2] for c in cursor_columns]
    section_tags = [(section, names, [c[2] for c in cols]) for section, names, cols in sections]
    varying = [t for t in cursor_tags if isinstance(t, list)]
    varying += [t for _, _, tags in section_tags for t in tags if isinstance(t, list)]

    def piece(row_tags: tuple[str | None, ...]) -> bytes:
        each = iter(row_tags)
        types: dict[str, Any] = {}
        parts = [next(each) if isinstance(t, list) else t for t in cursor_tags]
        if arity >= 0:  # a composite cursor always keeps its tag list
            types["cursor"] = parts
        elif parts[0] is not None:
            types["cursor"] = parts[0]
        for section, names, tags in section_tags:
            row = [next(each) if isinstance(t, list) else t for t in tags]
            if present := {n: t for n, t in zip(names, row, strict=True) if t is not None}:
                types[section] = present
        return b',"types":' + dumps(types) if types else b""

    if not varying:
        return [piece(())] * count
    cache: dict[tuple[str | None, ...], bytes] = {}
    out = []
    for row_tags in zip(*varying, strict=True):
        if (found := cache.get(row_tags)) is None:
            found = cache[row_tags] = piece(row_tags)
        out.append(found)
    return out


def _tails(fields: list[EventFields]) -> tuple[list[bytes], list[bytes]]:
    """Each event's optional last keys as two pieces: its ``change`` (one per distinct kind), and
    its ``table`` and ``committed_at`` (a transaction's rows share the very objects: compared by
    identity, hashed once per transaction)."""
    changes = list(map(_CHANGE, fields))
    change_piece = {c: b"" if c is None else b',"change":' + dumps(c) for c in set(changes)}
    cache: dict[tuple[Any, ...], bytes] = {}
    rest: list[bytes] = []
    table, at = fields[0].table, fields[0].committed_at
    piece = _table_and_time(table, at)
    for t, a in zip(map(_TABLE, fields), map(_COMMITTED_AT, fields), strict=True):
        if t is not table or a is not at:
            table, at = t, a
            key = (table, at, None if at is None else at.utcoffset())  # equal instants, other offsets
            if (found := cache.get(key)) is None:
                found = cache[key] = _table_and_time(table, at)
            piece = found
        rest.append(piece)
    return list(map(change_piece.__getitem__, changes)), rest


_CHANGE, _TABLE, _COMMITTED_AT = attrgetter("change"), attrgetter("table"), attrgetter("committed_at")


def _table_and_time(table: str | None, committed_at: dt.datetime | None) -> bytes:
    tail = b""
    if table is not None:
        tail += b',"table":' + dumps(table)
    if committed_at is not None:
        tail += b',"committed_at":' + dumps(_iso(committed_at))
    return tail


def encode_page(
    ids: EventIds, columns: KeysetColumns, tuples: Sequence[Any], table: str | None = None
) -> EncodedEvents | None:
    """A keyset page's events encoded column by column, without building rows or events.

    Exactly what ``encode_event(to_event(...))`` gives for each row of the page
    (``tests/poller/tick/test_page_encoding.py`` holds it to that). Usually each event comes out as
    its JSON bytes, made by one %-template per page from each column's JSON pieces (see
    :func:`_page_json`); otherwise (values needing different tags in one column) as its
    ``encode_event`` dict, built from columns converted in one pass each. Either way each row is
    hashed once for its event id. None when the columns are not simple enough for a shortcut
    (duplicate names, a composite cursor).
    """
    keys, cursor = columns.keys, columns.cursor
    if len(set(keys)) != len(keys):
        return None
    if not tuples:
        return [], []
    by_name: dict[str, Sequence[Any]] = dict(zip(keys, zip(*tuples, strict=True), strict=True))
    raw: Sequence[Any] = by_name.pop(columns.raw_cursor) if columns.raw_cursor is not None else by_name[cursor]
    distinct: Distinct | None = None
    if columns.convert is not None:  # the event carries the typed value (appended when not selected)
        by_name[cursor], distinct = _converted(columns.convert, raw)
    event_cursor = by_name.get(cursor, raw)
    if any(map(isinstance, event_cursor, repeat(tuple))):  # a composite cursor encodes differently
        return None
    ops: list[str] | None = None
    if columns.soft_delete is not None:
        ops = ["upsert" if f is None or f is False or f == 0 else "delete" for f in by_name[columns.soft_delete]]
    pk_names = columns.pk
    encoded = _page_json(ids, by_name, cursor, event_cursor, pk_names, ops, distinct, table)
    if encoded is not None:
        return encoded
    event_ids = ids.many(
        (dict(zip(pk_names, r, strict=True)) for r in zip(*(by_name[p] for p in pk_names), strict=True)),
        event_cursor,
    )
    docs = _page_docs(event_ids, by_name, cursor, raw, pk_names, ops if ops is not None else ["upsert"] * len(tuples))
    if table is not None:  # last, as encode_event writes it
        for doc in docs:
            doc["table"] = table
    return event_ids, docs


def _page_docs(
    event_ids: list[str],
    by_name: dict[str, Sequence[Any]],
    cursor: str,
    raw: Sequence[Any],
    pk_names: tuple[str, ...],
    ops: list[str],
) -> list[dict[str, Any]]:
    """Every event's ``encode_event`` dict, from columns encoded in one pass each (the path for
    columns whose rows need different tags)."""
    names, count = list(by_name), len(event_ids)
    encoded = {name: encode_column(by_name[name]) for name in names}
    cursor_values, cursor_tags = encoded[cursor] if cursor in encoded else encode_column(raw)
    afters = [dict(zip(names, r, strict=True)) for r in zip(*(encoded[n][0] for n in names), strict=True)]
    after_tags = _row_tags(names, [encoded[n][1] for n in names], count)
    pk_tags = _row_tags(list(pk_names), [encoded[p][1] for p in pk_names], count)
    pk_of = _pk_getter(pk_names)
    if names and not isinstance(cursor_tags, list) and not any(isinstance(encoded[n][1], list) for n in names):
        return _uniform_events(event_ids, ops, afters, cursor_values, pk_of, cursor_tags, pk_tags, after_tags)
    cursor_tag_of = cursor_tags if isinstance(cursor_tags, list) else repeat(cursor_tags)
    docs = []
    for event_id, op, after, a_tags, p_tags, value, tag in zip(
        event_ids, ops, afters, after_tags, pk_tags, cursor_values, cursor_tag_of, strict=False
    ):
        event: dict[str, Any] = {
            "event_id": event_id,
            "op": op,
            "pk": pk_of(after),
            "cursor": value,
            "after": after if after or op == "upsert" else None,
            "before": None,
        }
        types: dict[str, Any] = {}
        if tag is not None:
            types["cursor"] = tag
        if p_tags:
            types["pk"] = p_tags
        if a_tags and event["after"] is not None:
            types["after"] = a_tags
        if types:
            event["types"] = types
        docs.append(event)
    return docs


# A column as its distinct values and each row's index into them.
Distinct = tuple[list[Any], list[int]]


def _converted(convert: Callable[[Any], tuple[Any, Any]], raw: Sequence[Any]) -> tuple[list[Any], Distinct | None]:
    """The typed cursor of every row. Stored text (SQLite) is converted once per distinct value
    (then also returned as distinct values and each row's index): rows sharing a timestamp share
    its text, and equal strings convert alike (unlike equal datetimes or numbers, whose text can
    differ)."""
    if set(map(type, raw)) == {str}:
        at = {text: index for index, text in enumerate(dict.fromkeys(raw))}
        values = [convert(text)[1] for text in at]
        rows = list(map(at.__getitem__, raw))
        return list(map(values.__getitem__, rows)), (values, rows)
    return [convert(v)[1] for v in raw], None


def _distinct_json(distinct: Distinct) -> ColumnJson | None:
    """:func:`column_json` of a column given as its distinct values: each encoded once."""
    values, rows = distinct
    encoded = column_json(values)
    if encoded is None:
        return None
    pieces, spec, tag = encoded
    return list(map(pieces.__getitem__, rows)), spec, tag


def _page_json(
    ids: EventIds,
    by_name: dict[str, Sequence[Any]],
    cursor: str,
    event_cursor: Sequence[Any],
    pk_names: tuple[str, ...],
    ops: list[str] | None,
    distinct: Distinct | None = None,
    table: str | None = None,
) -> EncodedEvents | None:
    """Every event's JSON (exactly ``dumps(encode_event(event))``) from one bytes %-template.

    The template is the event object with a slot for each value; each column is encoded once
    into JSON pieces (:func:`~shared.codec.column_json`), and the event ids come from the same
    columns (:meth:`~shared.ids.EventIds.of_columns`). Each column has one tag for all its rows
    here, so one ``"types"`` object, written into the template, serves every event. None when a
    column needs per-row tags or a value needs the ids' fallback form.
    """
    json: dict[str, ColumnJson] = {}
    for name, values in by_name.items():
        converted = distinct if name == cursor else None  # the typed cursor, as distinct values
        if (encoded := column_json(values) if converted is None else _distinct_json(converted)) is None:
            return None
        json[name] = encoded
    cursor_json = json[cursor] if cursor in json else column_json(event_cursor)
    if cursor_json is None or any(p not in json for p in pk_names):
        return None
    pk = {p: by_name[p] for p in pk_names}
    event_ids = ids.of_columns(pk, event_cursor) if distinct is None else ids.of_columns(pk, *distinct)
    if event_ids is None:
        return None
    template = _template(json, cursor_json, pk_names, ops, table)
    values = [json[p][0] for p in pk_names] + [cursor_json[0]] + [c[0] for c in json.values()]
    if ops is not None:
        values.insert(0, list(map(_OP_BYTES.__getitem__, ops)))
    ids_bytes = "\x1f".join(event_ids).encode().split(b"\x1f")  # ids are ASCII: three C calls
    return event_ids, list(map(template.__mod__, zip(ids_bytes, *values, strict=True)))


def _template(
    json: dict[str, ColumnJson],
    cursor_json: ColumnJson,
    pk_names: tuple[str, ...],
    ops: list[str] | None,
    table: str | None,
) -> bytes:
    """The event object's bytes %-template: a slot per value (id, op, pk, cursor, after), one
    ``"types"`` object for every event."""
    types: dict[str, Any] = {"cursor": cursor_json[2]} if cursor_json[2] is not None else {}
    if pk_tags := {p: json[p][2] for p in pk_names if json[p][2] is not None}:
        types["pk"] = pk_tags
    if after_tags := {n: c[2] for n, c in json.items() if c[2] is not None}:
        types["after"] = after_tags

    def slot(name: str) -> bytes:
        return _literal(name) + b":" + json[name][1]

    template = (
        b'{"event_id":"%b","op":'
        + (b'"%b"' if ops is not None else b'"upsert"')
        + b',"pk":{'
        + b",".join(map(slot, pk_names))
        + b'},"cursor":'
        + cursor_json[1]
        + b',"after":{'
        + b",".join(map(slot, json))
        + b'},"before":null'
        + (b',"types":' + _literal(types) if types else b"")
        + (b',"table":' + _literal(table) if table is not None else b"")
        + b"}"
    )
    return template


_OP_BYTES = {"upsert": b"upsert", "delete": b"delete"}


def _literal(value: Any) -> bytes:
    """A fixed part of a %-template: its JSON with ``%`` escaped."""
    return dumps(value).replace(b"%", b"%%")


def _uniform_events(
    event_ids: list[str],
    ops: list[str],
    afters: list[dict[str, Any]],
    cursor_values: Sequence[Any],
    pk_of: Callable[[dict[str, Any]], dict[str, Any]],
    cursor_tag: str | None,
    pk_tags: Sequence[dict[str, str]],
    after_tags: Sequence[dict[str, str]],
) -> list[dict[str, Any]]:
    """The events of a page whose rows all have the same tags (no nulls among tagged columns, the
    common case): one shared "types" object, each event built in one expression. Every ``after``
    has values here, so it is never null."""
    types: dict[str, Any] = {"cursor": cursor_tag} if cursor_tag is not None else {}
    if pk_tags[0]:
        types["pk"] = pk_tags[0]
    if after_tags[0]:
        types["after"] = after_tags[0]
    rows = zip(event_ids, ops, afters, cursor_values, strict=True)
    if not types:
        return [
            {"event_id": i, "op": o, "pk": pk_of(a), "cursor": c, "after": a, "before": None} for i, o, a, c in rows
        ]
    return [
        {"event_id": i, "op": o, "pk": pk_of(a), "cursor": c, "after": a, "before": None, "types": types}
        for i, o, a, c in rows
    ]


def _pk_getter(pk_names: tuple[str, ...]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The event's pk object from its encoded values (a single-column key without a loop)."""
    if len(pk_names) == 1:
        (name,) = pk_names
        return lambda after: {name: after[name]}
    return lambda after: {p: after[p] for p in pk_names}


def _row_tags(names: list[str], tags: list[str | list[str | None] | None], count: int) -> Sequence[dict[str, str]]:
    """Each row's ``{column: tag}`` for its tagged values, in column order (one shared dict when
    every column has one tag for all its values)."""
    if not any(isinstance(t, list) for t in tags):
        return [{n: t for n, t in zip(names, tags, strict=True) if t is not None}] * count  # type: ignore[misc]
    columns = [t if isinstance(t, list) else repeat(t, count) for t in tags]
    return [{n: t for n, t in zip(names, row, strict=True) if t is not None} for row in zip(*columns, strict=True)]
