"""Every value travels (issue 42): the types the codec raised on, exact arrays, sets, ranges,
addresses, long intervals, and a value of a type it has never seen — never a stopped poller."""

from __future__ import annotations

import datetime as dt
import ipaddress
import math
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import codec
from shared.codec import Range
from shared.errors import SerializationError
from shared.models import Position, RowChange


class Point:
    """A type the codec has never seen (an extension type's driver value)."""

    def __str__(self) -> str:
        return "(1.5,2)"


def _through_envelope(value: Any) -> Any:
    """``value`` as a handler gets it: encoded in an event, sent as JSON, decoded by the worker."""
    event = RowChange(event_id="e", op="upsert", pk={"id": 1}, cursor=1, after={"v": value}, poller="p")
    raw = codec.loads(codec.dumps(codec.encode_event(event)))
    (decoded,) = codec.decode_events([raw], "p")
    alone = codec.decode_event(raw, "p")  # the fast path decodes as the one-event path does
    assert decoded.after is not None and alone.after is not None
    assert repr(decoded.after) == repr(alone.after)
    return decoded.after["v"]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, Decimal):
        return type(b) is Decimal and str(a) == str(b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize(
    ("value", "tag"),
    [
        (ipaddress.ip_address("192.168.0.1"), "ip_address"),
        (ipaddress.ip_address("::1"), "ip_address"),
        (ipaddress.ip_interface("10.1.2.3/8"), "ip_interface"),
        (ipaddress.ip_network("10.0.0.0/8"), "ip_network"),
        ({"b", "a"}, "set"),
        (set(), "set"),
        ([Decimal("1.10"), None, Decimal("NaN")], "array:decimal"),
        ([[dt.date(2024, 1, 1)], [dt.date(1, 1, 1)]], "array:array:date"),
        ([1, 2**60, None], "array:int"),
        ([1.5, math.inf, math.nan], "array:float"),
        ([b"", b"\x00"], "array:bytes"),
        (Range(1, 5, "[)"), "range:int"),
        (Range(None, Decimal("2.50"), "(]"), "range:decimal"),
        (Range(dt.datetime(2024, 1, 1, tzinfo=dt.UTC), None, "[)"), "range:timestamp"),
        (Range(empty=True), "range"),
        ({"n": 2**64, "f": [1.5, None]}, "json"),
        ([{"n": -(2**70)}, {"n": 1}], "array:json"),
        (dt.timedelta(days=-999_999_999), "interval"),
        (dt.timedelta(days=999_999_999, microseconds=999_999), "interval"),
        (dt.timedelta(hours=-838, minutes=-59, seconds=-59), "interval"),
    ],
)
def test_a_value_json_cannot_carry_travels_tagged_and_comes_back_exactly(value: Any, tag: str) -> None:
    # Given a value of a type the codec raised on (an address, a set, a range), or lost precision of
    # When it is encoded and decoded through an event
    # Then its tag names its type, and the handler gets the same value of the same type
    assert codec.encode_value(value)[1] == tag
    back = _through_envelope(value)
    assert _same(value, back) if not isinstance(value, set) else back == value and type(back) is set


def test_a_json_document_json_carries_exactly_travels_as_itself() -> None:
    # Given a jsonb value whose numbers every JSON reader keeps; Then it is sent as is, untagged
    assert codec.encode_value({"a": [1, 2.5, None, "x"], "b": {"c": True}}) == (
        {"a": [1, 2.5, None, "x"], "b": {"c": True}},
        None,
    )


def test_a_driver_range_travels_as_a_range() -> None:
    # Given psycopg's Range (what keyset and pg_logical read from an int4range)
    psycopg_range = pytest.importorskip("psycopg.types.range").Range
    # When it travels; Then the handler gets a Range with the same bounds
    back = _through_envelope(psycopg_range(1, 10, "[)"))
    assert (back.lower, back.upper, back.bounds, back.isempty) == (1, 10, "[)", False)
    assert _through_envelope(psycopg_range(empty=True)).isempty
    # and a multirange (PostgreSQL 14+) as a list of them
    multirange = pytest.importorskip("psycopg.types.multirange").Multirange
    back = _through_envelope(multirange([psycopg_range(1, 2, "[)"), psycopg_range(5, None, "[)")]))
    assert [(r.lower, r.upper, r.bounds) for r in back] == [(1, 2, "[)"), (5, None, "[)")]


def test_a_value_of_an_unknown_type_travels_as_its_text_and_never_raises() -> None:
    # Given a value of a type the codec has never seen (before: SerializationError, a stopped poller)
    # When it is encoded; Then it travels as its str, tagged with its type's name, and arrives as that text
    assert codec.encode_value(Point()) == ("(1.5,2)", "py:Point")
    assert _through_envelope(Point()) == "(1.5,2)"
    assert codec.encode_value([Point()]) == (["(1.5,2)"], "array:py:Point")


def test_the_state_blob_still_refuses_a_value_it_cannot_round_trip() -> None:
    # Given a checkpoint whose key holds a value only its text can carry
    # When it is encoded for the state blob; Then it is refused, never stored as text
    with pytest.raises(SerializationError):
        codec.encode_position(Position(cursor=1, pk={"id": Point()}))
    with pytest.raises(SerializationError):
        codec.encode_position(Position(cursor=1, pk={"id": [Point()]}))
    # while an exact one (an address key) round-trips
    position = Position(cursor=1, pk={"ip": ipaddress.ip_address("10.0.0.1"), "tags": {"a"}})
    assert codec.decode_position(codec.encode_position(position)) == position


@pytest.mark.parametrize(
    ("json_value", "tag"), [("x", "array:int"), (["x"], "array:int"), ("[1", "range:int"), (1, "py:X")]
)
def test_a_malformed_tagged_value_is_a_serialization_error(json_value: Any, tag: str) -> None:
    with pytest.raises(SerializationError):
        codec.decode_value(json_value, tag)


scalars = st.one_of(
    st.integers(min_value=-(2**64), max_value=2**64),
    st.decimals(places=4, allow_nan=False),
    st.floats(),
    st.dates(),
    st.datetimes(timezones=st.just(dt.UTC)),
    st.binary(max_size=8),
    st.timedeltas(),
    st.ip_addresses(),
)


@settings(max_examples=25, deadline=None)
@given(items=st.lists(st.one_of(st.none(), scalars), max_size=5))
def test_any_list_of_values_travels_and_homogeneous_ones_exactly(items: list[Any]) -> None:
    # Given a list (a PostgreSQL array when its items share a type, else a JSON array)
    # When it travels; Then it never raises, and a list of one type comes back exactly
    back = _through_envelope(items)
    if len({type(v) for v in items if v is not None}) <= 1:
        assert _same(items, back)


@settings(max_examples=25, deadline=None)
@given(td=st.timedeltas(), ip=st.ip_addresses(), prefix=st.integers(0, 32))
def test_intervals_and_addresses_round_trip_exactly(td: dt.timedelta, ip: Any, prefix: int) -> None:
    assert _through_envelope(td) == td
    assert _same(ip, _through_envelope(ip))
    network = ipaddress.ip_network(f"{ip}/{prefix}", strict=False)
    assert _same(network, _through_envelope(network))


@pytest.mark.parametrize(
    "column",
    [
        [ipaddress.ip_address("10.0.0.1"), ipaddress.ip_address("::1")],
        [Range(1, 5), Range(empty=True)],
        [{"a"}, set()],
        [[Decimal("1.5")], [Decimal("2")]],
        [{"n": 2**64}, {"n": 1}],
        [Point(), Point()],
        [dt.timedelta(days=-999_999_999), dt.timedelta(0)],
    ],
)
def test_a_page_column_of_new_types_encodes_as_its_values_do_one_by_one(column: list[Any]) -> None:
    # Given a page's column of values the codec used to refuse (the tick encodes pages column-wise)
    # When it is encoded as a column; Then each piece and tag is what encode_value gives that value
    pairs = [codec.encode_value(v) for v in column]
    values, tags = codec.encode_column(column)
    assert list(values) == [v for v, _ in pairs]
    assert (tags if isinstance(tags, list) else [tags] * len(column)) == [t for _, t in pairs]
    found = codec.column_json(column)
    if found is not None:  # None: the value-by-value path encodes it
        pieces, spec, tag = found
        assert [spec % piece for piece in pieces] == [codec.dumps(v) for v, _ in pairs]
        assert [tag] * len(column) == [t for _, t in pairs]
