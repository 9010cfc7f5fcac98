"""The encode path sends exactly what main sent, and every encoding decodes back to its events.

``data/encode_golden.json`` holds main's output (129ca76) for the pages of ``encode_golden.py``
(how it was made: that module's docstring). Message bodies, message ids, properties, batch ids,
epochs and event ids are a contract (Service Bus duplicate detection, handlers' de-duplication):
any difference fails here.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poller.ports import EventFields, Page, SourceRow
from poller.tick.epochs import Order, page_batches
from poller.tick.events import encode_rows, page_batch, to_event
from shared.codec import decode_batch, dumps, encode_event
from shared.ids import EventIds
from shared.messages import pack_batch
from shared.models import Lsn, Position, RowChange
from tests.poller.tick import encode_golden

GOLDEN = json.loads((Path(__file__).parent / "data" / "encode_golden.json").read_text(encoding="utf-8"))["cases"]


@pytest.mark.parametrize("name", sorted(encode_golden.cases()))
def test_the_same_bytes_and_ids_as_main(name: str) -> None:
    expected = GOLDEN[name]
    got = encode_golden.outputs_of(name)
    assert set(got) == set(expected)
    for packing, want in expected.items():
        assert got[packing] == want, f"{name} {packing} differs from main's output"


def test_every_case_is_in_the_fixture() -> None:
    assert set(GOLDEN) == set(encode_golden.cases())


# ----------------------------------------------------------------------------- round trips

ZONES = [dt.UTC, ZoneInfo("UTC"), ZoneInfo("Europe/Berlin"), dt.timezone(dt.timedelta(hours=-3, minutes=-30))]
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.decimals(allow_nan=False, places=2),
    st.datetimes(timezones=st.sampled_from(ZONES)),
    st.dates(),
    st.binary(max_size=5),
    st.uuids(),
    st.lists(st.integers(min_value=-5, max_value=2**60), max_size=3),
    st.lists(st.one_of(st.none(), st.text(max_size=3)), max_size=3),
    st.dictionaries(st.text(max_size=3), st.one_of(st.integers(), st.text(max_size=3), st.none()), max_size=3),
)
TABLES = st.sampled_from(["public.orders", "public.order_lines", 'public."we%ird"', "s.ü"])
COLUMNS = ["id", "status", "amount", "at", "doc"]


@st.composite
def pg_pages(draw: st.DrawFn) -> list[SourceRow]:
    """pg_logical-shaped pages: any mix of tables, changes, before images, NULLs and types."""
    rows: list[SourceRow] = []
    lsn = draw(st.integers(min_value=1, max_value=2**40))
    columns = draw(st.lists(st.sampled_from(COLUMNS[1:]), unique=True, max_size=4))
    for seq in range(draw(st.integers(min_value=1, max_value=25))):
        if draw(st.booleans()):
            lsn += draw(st.integers(min_value=1, max_value=500))
        key = draw(st.one_of(st.integers(), st.text(max_size=3)))
        new = {"id": key, **{c: draw(VALUES) for c in columns}}
        kind = draw(st.sampled_from(["insert", "update", "delete", "read"]))
        before = draw(st.one_of(st.none(), st.just({"id": key}), st.just({**new, "status": "old"})))
        fields = EventFields(
            pk={"id": key},
            cursor=(Lsn(lsn), seq),
            change=kind,
            before=None if kind in ("insert", "read") else before,
            table=draw(TABLES),
            version=f"read/1/t/{seq}" if kind == "read" else None,
            committed_at=draw(st.one_of(st.none(), st.datetimes(timezones=st.just(dt.UTC)))),
        )
        deleted = kind == "delete"
        rows.append(SourceRow(Position(Lsn(lsn), {"seq": seq}), {} if deleted else new, deleted, fields))
    return rows


def _same(a: Any, b: Any) -> bool:
    """Equal values, where a float NaN equals itself (a tagged float) and an aware datetime equals
    one of the same wall time and offset (a time in a zone's fold compares unequal to any other zone's)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dt.datetime) and isinstance(b, dt.datetime) and a.tzinfo is not None:
        return b.tzinfo is not None and (a.replace(tzinfo=None), a.utcoffset()) == (
            b.replace(tzinfo=None),
            b.utcoffset(),
        )
    return bool(a == b)


@settings(max_examples=150, deadline=None)
@given(rows=pg_pages(), limit=st.sampled_from([6 * 1024, 256 * 1024]), epoch=st.integers(min_value=0, max_value=3))
def test_pg_pages_round_trip_through_the_worker_decode(rows: list[SourceRow], limit: int, epoch: int) -> None:
    poller = encode_golden.PG
    page = Page(rows)
    batches, _ = page_batches(poller, "fp", page, page_batch(poller, "fp", page), Order(epoch, None))
    expected = [to_event(poller, "fp", row) for row in rows]
    decoded: list[RowChange] = []
    for batch in batches:
        messages = pack_batch(replace(batch, read_at=encode_golden.READ_AT), limit)
        # The same bytes as encoding the events built one by one (the reference path).
        reference = pack_batch(replace(batch, read_at=encode_golden.READ_AT, events=tuple(batch.events)), limit)
        assert messages == reference
        for message in messages:
            received = decode_batch(message.body)
            assert received.epoch == batch.epoch
            assert [e.event_id for e in received.events] == list(message.event_ids)
            decoded.extend(received.events)
    assert [e.event_id for e in decoded] == [e.event_id for e in expected]
    for got, want in zip(decoded, expected, strict=True):
        assert (got.op, got.cursor, got.pk, got.change, got.table) == (
            want.op,
            want.cursor,
            want.pk,
            want.change,
            want.table,
        )
        assert got.committed_at == want.committed_at
        for image in ("after", "before"):
            g, w = getattr(got, image), getattr(want, image)
            assert (g is None) == (w is None)
            if g is not None and w is not None:
                assert g.keys() == w.keys()
                assert all(_same(g[k], w[k]) for k in w)


def test_pages_the_template_cannot_write_fall_back_to_the_same_bytes() -> None:
    # Given change-log rows with a non-string column name, and keyset rows mixed into a page
    lsn = Lsn(99)
    values: dict[Any, Any] = {1: "one", "id": 1}
    odd = SourceRow(Position(lsn, {"seq": 0}), values, False, EventFields({"id": 1}, (lsn, 0), "insert", None, "t"))
    plain = SourceRow(Position(5, {"id": 5}), {"id": 5, "version": 5})
    for rows in ([odd], [odd, plain], [plain]):
        page = Page(rows)
        batch = replace(page_batch(encode_golden.PG, "fp", page), read_at=encode_golden.READ_AT)
        # Then nothing is pre-encoded, and what is sent is the events' encoding
        assert batch.events.encoded() is None  # type: ignore[attr-defined]
        assert pack_batch(batch, 256 * 1024) == pack_batch(replace(batch, events=tuple(batch.events)), 256 * 1024)
    assert encode_rows(EventIds("p", "fp"), []) == ([], [])


# Within 64 bits: a composite cursor with a wider integer has no event id at all (main raises too).
CURSOR_PARTS = st.one_of(
    st.integers(-(2**63), 2**63), st.text(max_size=2), st.decimals(allow_nan=False, places=1), st.dates()
)


@st.composite
def log_rows(draw: st.DrawFn) -> list[SourceRow]:
    """Change-log rows of any source's shape: scalar or composite cursors (whose parts' tags vary
    row to row), composite keys, versions, values that need tags only in some rows."""
    rows: list[SourceRow] = []
    cursor_shape = st.one_of(CURSOR_PARTS, st.tuples(CURSOR_PARTS, CURSOR_PARTS), st.tuples())
    for _ in range(draw(st.integers(min_value=1, max_value=12))):
        pk_names = draw(st.sampled_from([("id",), ("a", "b"), ()]))
        pk = {name: draw(st.one_of(st.integers(), st.text(max_size=2), st.uuids())) for name in pk_names}
        values = {**pk, **draw(st.dictionaries(st.sampled_from(["x", "y%", "z"]), VALUES, max_size=3))}
        deleted = draw(st.booleans())
        fields = EventFields(
            pk=pk,
            cursor=draw(cursor_shape),
            change=draw(st.sampled_from([None, "insert", "delete", "read"])),
            before=draw(st.one_of(st.none(), st.just(dict(pk)), st.just({}))),
            table=draw(st.one_of(st.none(), TABLES)),
            version=draw(st.one_of(st.none(), st.text(max_size=3))),
            committed_at=draw(st.one_of(st.none(), st.datetimes(timezones=st.sampled_from(ZONES)))),
        )
        rows.append(SourceRow(Position(0, {"seq": 0}), draw(st.sampled_from([values, {}])), deleted, fields))
    return rows


@settings(max_examples=300, deadline=None)
@given(rows=log_rows())
def test_encode_rows_is_each_event_encoded(rows: list[SourceRow]) -> None:
    poller, ids = encode_golden.PG, EventIds("p%", "fp")
    events = [to_event(poller, "fp", row, ids) for row in rows]
    assert encode_rows(ids, rows) == ([e.event_id for e in events], [dumps(encode_event(e)) for e in events])
