"""The fast pgoutput decoder (poller/sources/pg_logical/pgoutput.py) against the old per-field one.

Generated message streams (hypothesis): several relations re-sent mid-stream, inserts, updates
and deletes with no old tuple, an old key ('K') or a whole old row ('O'), NULLs, unchanged
TOASTed values ('u'), truncates, ignored messages, a skip position, a stop mid-transaction. Both
decoders must give the same changes, field for field (types and dict order included: ``repr``),
after every message, and the same errors. Then the rows built from them: the same as the old
``PgLogicalSource.row`` built.
"""

from __future__ import annotations

import datetime as dt
import struct
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poller.ports import EventFields, SourceRow
from poller.sources.pg_logical.pgoutput import Change, Decoder
from poller.sources.pg_logical.source import PgLogicalSource
from shared.errors import SourceError
from shared.models import Lsn, Position, SnapshotState
from tests.poller.pg_logical_support import poller_config
from tests.poller.sources.pg_logical import reference_pgoutput

# ---------------------------------------------------------------------------------------------- messages

_TYPES = (23, 25, 16, 1043, 90001)  # int4, text, bool, varchar, a user type


def _load(oid: int, data: bytes) -> Any:
    """Typed like psycopg's would be: ints, bools, text; a value "bad" is refused."""
    if data == b"bad":
        raise ValueError("refused")
    if oid == 23:
        return int(data) if data.strip(b"-").isdigit() else data.decode()
    if oid == 16:
        return data == b"t"
    return data.decode("utf-8", "replace")


class _TypeLoaders:
    """The fast path's loader shape (as peek.loader gives): a refused value arrives as its text."""

    def __init__(self) -> None:
        self.looked_up: list[int] = []

    def __call__(self, oid: int, data: bytes) -> Any:
        load = self.for_type(oid)
        try:
            return load(data)
        except Exception as exc:
            return self.refused(oid, data, exc)

    def for_type(self, oid: int) -> Callable[[bytes], Any]:
        self.looked_up.append(oid)
        return lambda data: _load(oid, data)

    def refused(self, oid: int, data: bytes, exc: Exception) -> Any:
        return f"as text: {data.decode('utf-8', 'replace')}"


def _begin(lsn: int, at: int, xid: int) -> bytes:
    return b"B" + struct.pack(">QqI", lsn, at, xid)


def _commit(lsn: int, end: int) -> bytes:
    return b"C" + struct.pack(">bQQq", 0, lsn, end, 0)


def _relation(oid: int, schema: str, name: str, identity: str, columns: Sequence[tuple[str, int, bool]]) -> bytes:
    body = struct.pack(">I", oid) + schema.encode() + b"\0" + name.encode() + b"\0" + identity.encode()
    body += struct.pack(">h", len(columns))
    for column, type_oid, key in columns:
        body += struct.pack(">b", 1 if key else 0) + column.encode() + b"\0" + struct.pack(">Ii", type_oid, -1)
    return b"R" + body


def _tuple(values: Sequence[bytes | str | None]) -> bytes:
    """Each value: bytes (text), None (NULL) or "u" (an unchanged TOASTed value)."""
    out = struct.pack(">h", len(values))
    for v in values:
        if v is None:
            out += b"n"
        elif isinstance(v, str):
            out += v.encode()  # "u", or a column kind nobody knows
        else:
            out += b"t" + struct.pack(">i", len(v)) + v
    return out


_VALUE = st.one_of(
    st.none(),
    st.just("u"),
    st.just(b"bad"),
    st.integers(-(2**31), 2**31 - 1).map(lambda i: str(i).encode()),
    st.sampled_from([b"t", b"f"]),
    st.text(max_size=12).map(str.encode),
)


Shapes = dict[int, list[tuple[str, int, bool]]]


def _values(draw: st.DrawFn, shapes: Shapes, oid: int, broken: bool) -> list[bytes | str | None]:
    """A tuple's values: as many as the relation has columns (what a server sends), or fewer, or
    (``broken``) one more."""
    width = len(shapes[oid])
    count = draw(st.sampled_from([width, width, width, width - 1, 0] + ([width + 1] if broken else [])))
    return [draw(_VALUE) for _ in range(count)]


def _change(draw: st.DrawFn, shapes: Shapes, op: str, oid: int, broken: bool) -> bytes:
    """One change message (``op``: I, U, D, T; X: a broken one)."""
    if op == "I":
        return b"I" + struct.pack(">I", oid) + b"N" + _tuple(_values(draw, shapes, oid, broken))
    if op in "UD":
        old = draw(st.sampled_from(["", "K", "O"] if op == "U" or broken else ["K", "O"]))  # a Delete has one
        body = b"" if not old else old.encode() + _tuple(_values(draw, shapes, oid, broken))
        if op == "U":
            body += draw(st.sampled_from([b"N"] * 9 + ([b"Q"] if broken else [])))
            body += _tuple(_values(draw, shapes, oid, broken))
        return op.encode() + struct.pack(">I", oid) + body
    if op == "T":
        rels = draw(st.lists(st.sampled_from(sorted(shapes)), min_size=1, max_size=3))
        return b"T" + struct.pack(">ib", len(rels), 0) + b"".join(struct.pack(">I", r) for r in rels)
    unknown = b"I" + struct.pack(">I", 99) + b"N" + _tuple([])  # a relation never described
    return draw(st.sampled_from([unknown, b"I" + struct.pack(">I", oid) + b"N" + _tuple(["q"])]))


@st.composite
def _streams(draw: st.DrawFn, *, broken: bool = False) -> list[bytes]:
    """A slot's messages: transactions over 1-3 relations (re-sent, sometimes with a column more)."""
    shapes: Shapes = {}
    names: dict[int, tuple[str, str, str]] = {}
    for k in range(draw(st.integers(1, 3))):
        oid = 16384 + k
        width = draw(st.integers(1, 5))
        keys = draw(st.lists(st.booleans(), min_size=width, max_size=width))
        shapes[oid] = [(f"c{i}", draw(st.sampled_from(_TYPES)), keys[i]) for i in range(width)]
        names[oid] = (draw(st.sampled_from(["public", "s", ""])), f"t{k}", draw(st.sampled_from("dfni")))
    messages = [_relation(oid, *names[oid], shapes[oid]) for oid in shapes]
    lsn = 0x1000
    for _ in range(draw(st.integers(0, 5))):
        lsn += draw(st.integers(1, 1000))
        messages.append(_begin(lsn, draw(st.integers(0, 2**40)), draw(st.integers(0, 2**32 - 1))))
        for _ in range(draw(st.integers(0, 6))):
            oid = draw(st.sampled_from(sorted(shapes)))
            op = draw(st.sampled_from("IUDTRYOMR" if not broken else "IUDTRYOMRX"))
            if op == "R":
                if draw(st.booleans()):  # ALTER TABLE ... ADD COLUMN
                    shapes[oid] = [*shapes[oid], (f"c{len(shapes[oid])}", draw(st.sampled_from(_TYPES)), False)]
                messages.append(_relation(oid, *names[oid], shapes[oid]))
            elif op in "YOM":  # Type, Origin, Message: nothing for the stream
                messages.append(op.encode() + draw(st.binary(max_size=8)))
            else:
                messages.append(_change(draw, shapes, op, oid, broken))
        end = lsn + draw(st.integers(1, 100))
        messages.append(_commit(lsn, end))
        lsn = end
    return messages


def _run(decoder: Any, messages: Sequence[bytes], stop: int | None) -> list[Any]:
    """What a reader sees: after each message, the changes returned, pending and in_transaction;
    at ``stop`` the partial transaction; or the error that ended it."""
    seen: list[Any] = []
    try:
        for i, data in enumerate(messages):
            if i == stop:
                seen.append(("partial", _shown(decoder.partial())))
                break
            seen.append((_shown(list(decoder.feed(data))), decoder.pending, decoder.in_transaction))
    except (SourceError, KeyError, IndexError, ValueError) as exc:  # ValueError: a plain loader refused
        seen.append(("error", type(exc).__name__, str(exc)))
    return seen


def _shown(changes: list[Change]) -> str:
    """Every field, types and dict order included (repr shows last_in_txn too)."""
    return repr(changes)


def _skip_of(messages: Sequence[bytes], pick: int) -> tuple[int, int] | None:
    begins = [struct.unpack_from(">Q", m, 1)[0] for m in messages if m[:1] == b"B"]
    if not begins or pick == 0:
        return None
    return (begins[pick % len(begins)], pick % 4 - 1)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(messages=_streams(), pick=st.integers(0, 20), stop=st.one_of(st.none(), st.integers(0, 60)))
def test_the_fast_decoder_gives_the_reference_decoders_changes(
    messages: list[bytes], pick: int, stop: int | None
) -> None:
    skip = _skip_of(messages, pick)
    expected = _run(reference_pgoutput.Decoder(_load, skip_through=skip), messages, stop)
    got = _run(Decoder(_load, skip_through=skip), messages, stop)
    assert got == expected


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(messages=_streams())
def test_with_type_loaders_a_refused_value_arrives_as_the_reference_gives_it(messages: list[bytes]) -> None:
    loaders = _TypeLoaders()
    expected = _run(reference_pgoutput.Decoder(_TypeLoaders()), messages, None)
    got = _run(Decoder(loaders), messages, None)
    assert got == expected
    assert len(loaders.looked_up) == len(set(loaders.looked_up))  # each type's loader looked up once


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(messages=_streams(broken=True))
def test_broken_streams_fail_as_the_reference_fails(messages: list[bytes]) -> None:
    expected = _run(reference_pgoutput.Decoder(_load), messages, None)
    got = _run(Decoder(_load), messages, None)
    assert got == expected


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([_begin(1, 0, 1), b"I" + struct.pack(">I", 7) + b"N" + _tuple([])], "relation 7 before its Relation"),
        ([b"I" + struct.pack(">I", 7) + b"N" + _tuple([])], "outside a transaction"),
        ([_relation(7, "public", "t", "d", [("a", 25, True)]), _begin(1, 0, 1),
          b"I" + struct.pack(">I", 7) + b"N" + _tuple([b"x", b"y"])], "2 columns for public.t, which has 1"),
        ([_relation(7, "public", "t", "d", [("a", 25, True)]), _begin(1, 0, 1),
          b"I" + struct.pack(">I", 7) + b"N" + _tuple(["b"])], "unknown column kind 'b'"),
        ([_relation(7, "public", "t", "d", [("a", 25, True)]), _begin(1, 0, 1),
          b"U" + struct.pack(">I", 7) + b"K" + _tuple([b"x"]) + b"O" + _tuple([b"x"])], "expected a new tuple"),
        ([b"S" + struct.pack(">I", 1)], "unknown message type 'S'"),  # e.g. streaming, never asked for
    ],
)  # fmt: skip
def test_what_it_does_not_know_stops_it(messages: list[bytes], error: str) -> None:
    decoder = Decoder(_load)
    with pytest.raises(SourceError, match=error):
        for data in messages:
            decoder.feed(data)


# ---------------------------------------------------------------------------------------------- rows


def _reference_row(name: str, pk_cols: tuple[str, ...], c: Change, state: SnapshotState | None) -> SourceRow:
    """PgLogicalSource.row as it was before issue 41 (its key columns given)."""
    deleted = c.kind == "delete"
    image = c.old if deleted else c.new
    assert image is not None or deleted
    source = image or {}
    missing = [p for p in pk_cols if p not in source]
    if missing:
        raise SourceError(
            f"poller {name}: {c.kind} on {c.relation.qualified} at {c.commit_lsn} lacks key column(s) {missing}",
            hint=f"give {c.relation.qualified} a primary key (or REPLICA IDENTITY FULL), or set pk to its key",
        )
    before = c.old
    if c.kind == "update" and c.old_is_key and c.old is not None:
        before = {p: c.old[p] for p in pk_cols if p in c.old}
    fields = EventFields(
        pk={p: source[p] for p in pk_cols},
        cursor=(c.commit_lsn, c.seq),
        change=c.kind,
        before=before,
        table=c.relation.qualified,
        committed_at=c.commit_time,
    )
    return SourceRow(Position(c.commit_lsn, {"seq": c.seq}, state), dict(c.new or {}), deleted, fields)


@pytest.fixture(scope="module")
def source() -> PgLogicalSource:
    """A source that never connects: rows only (its key columns set per test)."""
    return PgLogicalSource(poller_config("postgresql+psycopg://nobody@127.0.0.1:1/none", "t0"))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(messages=_streams(), n_keys=st.integers(1, 2), configured=st.booleans())
def test_rows_are_the_reference_rows(
    source: PgLogicalSource, messages: list[bytes], n_keys: int, configured: bool
) -> None:
    changes: list[Change] = []
    decoder = Decoder(_TypeLoaders())
    try:
        for data in messages:
            changes.extend(c for c in decoder.feed(data) if c.kind != "truncate")
    except KeyError:  # a FULL identity's old row shorter than its new one: see the decoder tests
        pass
    pk = tuple(f"c{i}" for i in range(n_keys))
    source._fixed_pk = pk if configured else None
    source._pks.clear()
    if not configured:
        source._pks.update({c.relation.oid: pk for c in changes})  # as _pk found them: the primary key
    state = SnapshotState(id="s1", tables=("public.t0",), chunk_size=10) if configured else None
    for c in changes:
        try:
            expected: Any = repr(_reference_row("p", pk, c, state))
        except SourceError as exc:
            expected = ("error", str(exc))
        try:
            got: Any = repr(source.row(None, c, state))  # type: ignore[arg-type]  # the key is known: no query
        except SourceError as exc:
            got = ("error", str(exc))
        assert got == expected


def test_a_transactions_rows_share_one_commit_time_and_each_transaction_gets_its_own(source: PgLogicalSource) -> None:
    rel = _relation(16384, "public", "t0", "d", [("c0", 23, True)])
    insert = b"I" + struct.pack(">I", 16384) + b"N" + _tuple([b"1"])
    messages = [rel, _begin(100, 5_000_000, 1), insert, insert, _commit(100, 110),
                _begin(200, 6_000_000, 2), insert, _commit(200, 210)]  # fmt: skip
    decoder = Decoder(_load)
    changes = [c for data in messages for c in decoder.feed(data)]
    source._fixed_pk = ("c0",)
    rows = [source.row(None, c, None) for c in changes]  # type: ignore[arg-type]
    at = [r.event.committed_at for r in rows if r.event is not None]
    epoch = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
    assert at == [epoch + dt.timedelta(seconds=5)] * 2 + [epoch + dt.timedelta(seconds=6)]
    assert [r.position.cursor for r in rows] == [Lsn(100), Lsn(100), Lsn(200)]
