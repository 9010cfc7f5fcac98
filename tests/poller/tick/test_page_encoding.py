"""The column-wise page encoding is byte for byte the event-by-event one.

A keyset page is packed straight from its fetched tuples (:func:`poller.tick.events.encode_page`):
the message bodies, message ids and event ids must be exactly those of building every
``RowChange`` and encoding it with ``encode_event`` (the wire format and ids are a contract).
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from poller.ports import KeysetColumns, Page
from poller.sources.keyset.source import SqlSource
from poller.tick.events import LazyEvents, encode_page, keyset_table, page_batch, to_event
from shared.codec import column_json, dumps, encode_column, encode_event, loads
from shared.config import PollerConfig
from shared.ids import EventIds
from shared.messages import OutgoingMessage, pack_batch
from tests.poller.tick_support import make_poller
from tests.support.databases import PG_URL, unique_name, unreachable_reason

POLLER = make_poller("sqlite://", cursor="c", pk=("id",))
ZONES = [dt.UTC, dt.timezone(dt.timedelta(hours=5, minutes=30)), ZoneInfo("America/New_York")]

SCALARS = [
    st.none(),
    st.booleans(),
    st.integers(),  # beyond 2**53 (a string with a tag) and beyond 64 bits (the ids' fallback)
    st.sampled_from([2**53 - 1, 2**53, 1 - 2**53, -(2**53), 2**64, -(2**63) - 1]),  # the edges
    st.floats(),  # NaN and infinities travel tagged
    st.text(max_size=6),  # unicode, surrogates excluded by hypothesis' default alphabet
    st.decimals(places=3, allow_nan=False),
    st.decimals(),
    st.datetimes(timezones=st.sampled_from(ZONES)),
    st.datetimes(),
    st.dates(),
    st.times(),
    st.uuids(),
    st.binary(max_size=4),
    st.timedeltas(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
]
scalar = st.one_of(*SCALARS)


@st.composite
def columns(draw: st.DrawFn) -> list[list[Any]]:
    """Columns of one type (the fast paths), nullable ones, and mixed ones."""
    rows = draw(st.integers(1, 8))
    out = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["one", "nullable", "mixed"]))
        value = draw(st.sampled_from(SCALARS))
        if kind == "mixed":
            value = scalar
        elif kind == "nullable":
            value = st.one_of(st.none(), value)
        out.append(draw(st.lists(value, min_size=rows, max_size=rows)))
    return out


def _expected(
    keyset: KeysetColumns, tuples: list[tuple[Any, ...]], poller: PollerConfig = POLLER
) -> list[tuple[str, bytes]]:
    ids = EventIds(POLLER.name, "fp")
    events = [to_event(poller, "fp", row, ids) for row in map(keyset.row_builder(), tuples)]
    return [(e.event_id, dumps(encode_event(e))) for e in events]


def _fast(
    keyset: KeysetColumns, tuples: list[tuple[Any, ...]], poller: PollerConfig = POLLER
) -> list[tuple[str, bytes]] | None:
    """encode_page's events as the wire carries them (each one's JSON bytes)."""
    encoded = encode_page(EventIds(POLLER.name, "fp"), keyset, tuples, keyset_table(poller))
    if encoded is None:
        return None
    # Each event comes as its JSON (the template path) or as its encode_event dict.
    return [(i, doc if isinstance(doc, bytes) else dumps(doc)) for i, doc in zip(*encoded, strict=True)]


@settings(max_examples=300, deadline=None)
@given(
    data=columns(),
    cursor=st.lists(
        st.one_of(st.integers(), st.datetimes(timezones=st.sampled_from(ZONES)), st.text(max_size=4)),
        min_size=8,
        max_size=8,
    ),
    ids=st.lists(
        st.one_of(st.integers(), st.uuids(), st.text(max_size=4), st.decimals(allow_nan=False)), min_size=8, max_size=8
    ),
    soft=st.lists(
        st.one_of(st.none(), st.booleans(), st.integers(0, 2), st.just(dt.datetime(2026, 1, 1))), min_size=8, max_size=8
    ),
    raw_cursor=st.booleans(),
    typed=st.sampled_from([lambda v: {"typed": v}, lambda v: ("typed", v)]),
    with_soft=st.booleans(),
    query=st.booleans(),
)
def test_a_page_encodes_to_the_same_events_as_building_them(
    data, cursor, ids, soft, raw_cursor, typed, with_soft, query
) -> None:
    # A poller on a table names it in every event; a query poller's events name none.
    poller = replace(POLLER, table=None, query="SELECT 1") if query else POLLER
    rows = len(data[0])
    names = [f"col_{i}" for i in range(len(data))]
    keys = ["id", "c", *names, *(["deleted_at"] if with_soft else []), *(["raw"] if raw_cursor else [])]
    table = [
        ids[:rows],
        cursor[:rows],
        *data,
        *([soft[:rows]] if with_soft else []),
        *([cursor[:rows]] if raw_cursor else []),
    ]
    tuples = list(zip(*table, strict=True))
    keyset = KeysetColumns(
        tuple(keys),
        "c",
        ("id",),
        "raw" if raw_cursor else None,
        (lambda v: (v, typed(v))) if raw_cursor else None,  # a converter: position raw, event typed
        "deleted_at" if with_soft else None,
    )
    fast = _outcome(lambda: _fast(keyset, tuples, poller))
    if fast is None:  # no shortcut: only for a composite (tuple) event cursor, which encodes as a list of parts
        assert raw_cursor and isinstance(typed(0), tuple)
    else:
        assert fast == _outcome(lambda: _expected(keyset, tuples, poller))


@settings(max_examples=300, deadline=None)
@given(data=columns())
def test_a_column_as_json_pieces_is_what_dumps_writes_for_each_encoded_value(data: list[list[Any]]) -> None:
    # Given a column (one type, nullable or mixed); When it is encoded as template pieces; Then
    # each piece in its slot is exactly the JSON of encode_column's value, with the same tag;
    # and only a column needing different tags (or an unencodable one) has no pieces.
    for column in data:
        expected = _outcome(lambda column=column: encode_column(column))
        pieces = column_json(column)
        if pieces is None:
            assert isinstance(expected[1], list) or isinstance(expected[0], type), (column, expected)
            continue
        values, spec, tag = pieces
        assert (tag, [spec % v for v in values]) == (expected[1], [dumps(v) for v in expected[0]])


def _whole_minute_offset(value: dt.datetime) -> bool:
    offset = value.utcoffset()
    return offset is not None and offset.seconds % 60 == 0


_TIMESTAMPS: st.SearchStrategy[dt.datetime] = st.datetimes(timezones=st.sampled_from(ZONES)).filter(
    _whole_minute_offset
)


@settings(max_examples=200, deadline=None)
@given(
    count=st.integers(1, 8),
    kind=st.sampled_from(["one", "mixed"]),
    key=st.sampled_from([*SCALARS[2:4], st.uuids(), st.text(max_size=4), st.decimals(allow_nan=False), _TIMESTAMPS]),
    cursor=st.sampled_from([st.integers(), _TIMESTAMPS, st.datetimes(timezones=st.sampled_from(ZONES)), st.dates()]),
    data=st.data(),
)
def test_event_ids_from_columns_are_the_row_by_row_ids(count: int, kind: str, key: Any, cursor: Any, data: Any) -> None:
    # Given a page's pk columns (two, named so that they sort differently) and cursor column;
    # Then the ids hashed from one template are the row-by-row ids (or None: row by row it is).
    ids = EventIds("p%", "fp")
    pk = {
        name: data.draw(st.lists(key if kind == "one" else scalar, min_size=count, max_size=count))
        for name in ("z", "a%")
    }
    cursors = data.draw(st.lists(cursor, min_size=count, max_size=count))
    expected = _outcome(
        lambda: ids.many((dict(zip(pk, r, strict=True)) for r in zip(*pk.values(), strict=True)), cursors)
    )
    fast = ids.of_columns(pk, cursors)
    assert fast is None or fast == expected
    wide = [v for v in [*cursors, *pk["z"], *pk["a%"]] if type(v) is int and not -(2**63) <= v < 2**64]
    if kind == "one" and not wide:  # one common type within orjson's integers: one template
        assert fast is not None


def test_a_page_with_one_tag_a_column_comes_as_json_text() -> None:
    keyset = KeysetColumns(("id", "c", "v", "w"), "c", ("id",))
    tuples = [
        (1, dt.datetime(2026, 1, 1, tzinfo=dt.UTC), Decimal("1.5"), "a"),
        (2, dt.datetime(2026, 1, 1, 0, 0, 1, 5, tzinfo=dt.UTC), Decimal("2"), None),
    ]
    encoded = encode_page(EventIds(POLLER.name, "fp"), keyset, tuples, keyset_table(POLLER))
    assert encoded is not None and all(isinstance(raw, bytes) for raw in encoded[1])
    assert all(isinstance(raw, bytes) and loads(raw)["table"] == "orders" for raw in encoded[1])  # names its table
    assert _fast(keyset, tuples) == _expected(keyset, tuples)


def _outcome(encode: Any) -> Any:
    """What encoding gives, or the error it raises (both paths must refuse the same data)."""
    try:
        return encode()
    except Exception as exc:
        return type(exc), str(exc)


@pytest.mark.parametrize(
    "tuples",
    [
        [(1, 10, "a"), (2, 10, "b"), (3, 11, None)],  # nothing tagged: events without "types"
        [(1, 10, Decimal("1.5")), (2, 11, Decimal("2"))],  # every row tagged alike: one shared "types"
        [(1, 10, Decimal("1.5")), (2, 11, None)],  # tags differ by row
        [(2**60, dt.datetime(2026, 1, 1, tzinfo=dt.UTC), "é")],  # tagged pk and cursor
    ],
)
def test_uniform_and_varied_pages_encode_like_their_events(tuples: list[tuple[Any, ...]]) -> None:
    keyset = KeysetColumns(("id", "c", "v"), "c", ("id",))
    assert _fast(keyset, tuples) == _expected(keyset, tuples)


def test_a_converted_cursor_missing_from_the_values_is_appended_last_like_the_row_builder() -> None:
    keyset = KeysetColumns(
        ("id", "v", "raw"), "c", ("id",), "raw", lambda v: (v, dt.datetime.fromisoformat(v + "+00:00"))
    )
    tuples = [(1, "é", "2026-01-01 10:00:00"), (2, None, "2026-01-01 10:00:01.5")]
    assert _fast(keyset, tuples) == _expected(keyset, tuples)


def _messages(poller: Any, source: SqlSource, page: Page, limit: int) -> list[OutgoingMessage]:
    return pack_batch(page_batch(poller, source.fingerprint, page), limit)


def _varied_table(url: str, nulls: bool) -> tuple[str, sa.Engine]:
    """Without ``nulls``, only untagged columns hold NULLs: every page takes the template path."""
    engine = sa.create_engine(url)
    name = unique_name("enc")
    md = sa.MetaData()
    table = sa.Table(
        name,
        md,
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("amount", sa.Numeric(30, 4)),
        sa.Column("big", sa.BigInteger()),
        sa.Column("ref", sa.Uuid()),
        sa.Column("note", sa.Text()),
        sa.Column("ratio", sa.Float()),
        sa.Column("day", sa.Date()),
        sa.Column("deleted_at", sa.DateTime(timezone=True)),
    )
    md.create_all(engine)
    start = dt.datetime(2026, 3, 29, 0, 59, 59, 999_999, tzinfo=dt.UTC)
    rows = [
        {
            "id": i,
            "updated_at": start + dt.timedelta(microseconds=i // 3 * 250_001),  # ties across pages
            "amount": None if nulls and i % 7 == 0 else Decimal(f"{i * 1.5:.4f}") * (-1 if i % 2 else 1),
            "big": None if nulls and i % 5 == 0 else 2**62 + i if i % 3 or not nulls else 2**53 + i,
            "ref": None if nulls and i % 4 == 0 else uuid.UUID(int=i * 7919),
            "note": None if i % 6 == 0 else f'é😀 {i} "quoted" \\ {"x" * (i % 40)}',
            "ratio": None if i % 8 == 0 else i / 3,
            "day": dt.date(2026, 1, 1) + dt.timedelta(days=i),
            "deleted_at": start if nulls and i % 9 == 0 else None,  # soft deletes
        }
        for i in range(250)
    ]
    with engine.begin() as conn:
        conn.execute(table.insert(), rows)
    return name, engine


@pytest.fixture(params=[("sqlite", True), ("postgresql", True), ("sqlite", False), ("postgresql", False)])
def varied(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    database, nulls = request.param
    url = f"sqlite:///{tmp_path / 'src.db'}" if database == "sqlite" else PG_URL
    if database == "postgresql" and (reason := unreachable_reason(PG_URL)) is not None:
        pytest.skip(reason)
    name, engine = _varied_table(url, nulls)
    yield make_poller(url, name, cursor="updated_at", soft_delete_column="deleted_at", cursor_timezone="UTC"), nulls
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
    engine.dispose()


@pytest.mark.parametrize("limit", [256 * 1024, 16 * 1024])  # one message a page, and several
def test_a_fetched_page_packs_into_the_very_messages_of_the_event_by_event_path(varied: Any, limit: int) -> None:
    # Given pages of every common column type (with NULLs in tagged columns: per-row tags; without:
    # the template path); Then the very messages of building and encoding every event.
    poller, nulls = varied
    source = SqlSource(poller)
    after, pages = None, 0
    while len(page := source.fetch(after, 100)):
        assert page.columns is not None  # the shortcut applies to this source
        batch = page_batch(poller, source.fingerprint, page)
        fast = pack_batch(batch, limit)
        assert isinstance(batch.events, LazyEvents) and "not built yet" in repr(batch.events)  # no events built
        encoded = batch.events.encoded()
        assert encoded is not None and isinstance(encoded[1][0], bytes) is not nulls  # which path
        slow_page = Page(tuples=page.tuples, make_row=page.columns.row_builder())  # no columns: builds every event
        assert fast == _messages(poller, source, slow_page, limit)  # bodies, message ids, event ids, properties
        after, pages = page.last, pages + 1
    assert pages == 3
